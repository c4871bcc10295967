"""Resolve the JVM artifacts the platform needs from Maven Central into CACHE_DIR, once.

Dependency-only Maven projects live in infra/artifacts/maven/:
  kafka/        the Kafka broker (kafka_2.13) + a log4j2 SLF4J binding  -> .cache/jars/kafka/
  spark-kafka/  Spark's Kafka connector for the installed pyspark     -> .cache/jars/spark-kafka/
  spark-avro/   Spark's Avro functions, same version (wire bench only) -> .cache/jars/spark-avro/
  hdfs/         an HDFS NameNode and DataNode (hadoop-hdfs + hadoop-common) -> .cache/jars/hdfs/

Each output dir gets a stamp file (.stamp.json) written after a successful copy. While the stamp matches
(same requested versions, same pom/settings content, all jars present) Maven is not run at all, so a
warm cache works offline.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.paths import CACHE_DIR

# 4.4.0 is on Central but incomplete there (org.apache.kafka:kafka-tools-api:4.4.0 is missing), so
# kafka_2.13:4.4.0 cannot be resolved; 4.3.1 is the newest release that resolves fully.
KAFKA_VERSION = "4.3.1"

# Spark's Kafka connector for the installed pyspark 4.3.0: its 4.3.0 build is not on the Maven Central
# reachable here, and 4.2.0 works with it (tests/integration/test_processor_realtime.py proves the
# pair). Both must share Spark's major version (4) and Scala's (2.13).
SPARK_KAFKA_VERSION = "4.2.0"

# spark-token-provider-kafka-0-10 of the connector's version is missing from the Central we reach:
# these are tried in order. 4.0.0 has every method spark-sql-kafka 4.2.0 calls but for Kerberos
# delegation-token logging, a path unused here.
TOKEN_PROVIDER_FALLBACKS = ("4.0.0",)

# HDFS for job state (infra/local/hdfs.py): the version of the Hadoop client pyspark 4.3.0 ships
# (hadoop-client-api/runtime), so the processor's client and the servers speak one release.
HADOOP_VERSION = "3.5.0"

# Zipkin's server, the tracing UI: one self-contained `exec` jar (io.zipkin:zipkin-server:<v>:exec).
ZIPKIN_VERSION = "3.6.1"

MAVEN_DIR = Path(__file__).resolve().parent / "maven"
SETTINGS_XML = MAVEN_DIR / "settings.xml"
STAMP_NAME = ".stamp.json"
STAMP_FORMAT = 1

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    # Default when a library caller triggers a fetch implicitly: a long silent pause would be confusing.
    print(f"[infra.artifacts.fetch] {msg}", file=sys.stderr)


@dataclass(frozen=True)
class Resolved:
    """Outcome of one bundle: its jars and the versions actually used."""

    name: str
    jars: list[Path]
    versions: dict[str, str]
    fetched: bool  # False when served from the stamp (no Maven run)


def jars_dir(bundle: str, cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / "jars" / bundle


def m2_dir(cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / "m2"


def pyspark_version() -> str:
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError as e:
        raise InfraError(
            "pyspark is not installed in this interpreter; install the project (pip install -e .)"
        ) from e


def pyspark_jars_dir() -> Path:
    """pyspark's bundled jars/ directory (located without importing pyspark)."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise InfraError(
            "pyspark is not installed in this interpreter; install the project (pip install -e .)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "jars"
    if not path.is_dir():
        raise InfraError(f"pyspark has no jars directory at {path}; reinstall pyspark")
    return path


def require_tool(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise InfraError(f"`{tool}` not found on PATH; {hint}")
    return path


def require_java() -> str:
    return require_tool("java", "install a JDK 17+ (Debian: apt-get install -y openjdk-17-jdk-headless)")


def require_mvn() -> str:
    return require_tool("mvn", "install Maven (Debian: apt-get install -y maven) or run once where it exists")


_VERSIONED = re.compile(r"^(?P<artifact>.+?)-(?P<version>\d+\.\d+.*)\.jar$")
_VERSIONED_LOOSE = re.compile(r"^(?P<artifact>.+?)-(?P<version>\d.*)\.jar$")


def artifact_name(jar: Path | str) -> str:
    """Artifact id of a Maven-style jar file name: 'commons-pool2-2.13.1.jar' -> 'commons-pool2'.

    The version is taken to start at the first '-<digits>.<digits>', so ids that contain '-<digit>'
    themselves survive ('spark-sql-kafka-0-10_2.13-4.2.0.jar' -> 'spark-sql-kafka-0-10_2.13').
    """
    name = Path(jar).name
    match = _VERSIONED.match(name) or _VERSIONED_LOOSE.match(name)
    if match:
        return match.group("artifact")
    return name.removesuffix(".jar")


def exclude_shipped(jars: Iterable[Path], shipped_dir: Path) -> list[Path]:
    """Drop jars whose artifact (any version) already exists in shipped_dir (e.g. pyspark/jars)."""
    shipped = {artifact_name(p) for p in shipped_dir.glob("*.jar")}
    return [j for j in jars if artifact_name(j) not in shipped]


def _digest(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _read_stamp(out_dir: Path) -> dict[str, object] | None:
    try:
        data = json.loads((out_dir / STAMP_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _stamped_jars(out_dir: Path, requested: Mapping[str, str], inputs_digest: str) -> Resolved | None:
    stamp = _read_stamp(out_dir)
    if stamp is None or stamp.get("format") != STAMP_FORMAT:
        return None
    if stamp.get("requested") != dict(requested) or stamp.get("inputs") != inputs_digest:
        return None
    names = stamp.get("jars")
    versions = stamp.get("versions")
    if not isinstance(names, list) or not isinstance(versions, dict):
        return None
    jars = [out_dir / str(n) for n in names]
    if not jars or not all(j.is_file() for j in jars):
        return None
    return Resolved(out_dir.name, jars, {str(k): str(v) for k, v in versions.items()}, fetched=False)


def _run_maven(pom: Path, out_dir: Path, props: Mapping[str, str], cache_dir: Path) -> tuple[int, str]:
    mvn = require_mvn()
    require_java()
    argv = [
        mvn,
        "-q",
        "-B",
        "-Dstyle.color=never",
        "-s",
        str(SETTINGS_XML),
        f"-Dmaven.repo.local={m2_dir(cache_dir)}",
        "-f",
        str(pom),
        *(f"-D{k}={v}" for k, v in props.items()),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={out_dir}",
        "-DincludeScope=runtime",
    ]
    # Maven writes its [ERROR] lines to stdout; keep both streams for the error message.
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Maven's generic advice after every failure; it hides the one line that matters.
_MAVEN_BOILERPLATE = ("-e switch", "-X switch", "[ERROR] [Help 1]", "please read the following articles")


def _maven_error(bundle: str, rc: int, output: str) -> InfraError:
    lines = [
        ln.replace(" -> [Help 1]", "")
        for ln in _ANSI.sub("", output).splitlines()
        if ln.strip() not in ("", "[ERROR]") and not any(b in ln for b in _MAVEN_BOILERPLATE)
    ]
    tail = "\n".join(lines[-15:]) or "(no output)"
    return InfraError(
        f"maven could not resolve the {bundle} jars (exit {rc}). Check network access to Maven Central "
        f"and the versions in infra/artifacts/maven/{bundle}/pom.xml. Last maven output:\n{tail}"
    )


def _resolve(
    bundle: str,
    requested: Mapping[str, str],
    attempts: list[dict[str, str]],
    cache_dir: Path,
    log: Log,
    retry_if: Callable[[str], bool] = lambda _output: False,
) -> Resolved:
    """Serve the bundle from its stamp, or run Maven with each attempt's properties until one works."""
    pom = MAVEN_DIR / bundle / "pom.xml"
    out_dir = jars_dir(bundle, cache_dir)
    inputs = _digest([pom, SETTINGS_XML])
    cached = _stamped_jars(out_dir, requested, inputs)
    if cached is not None:
        return cached

    failure: InfraError | None = None
    for i, props in enumerate(attempts):
        shown = ", ".join(f"{k}={v}" for k, v in props.items())
        log(f"resolving {bundle} jars with maven ({shown}) into {out_dir} ...")
        # copy-dependencies never deletes, so start empty to avoid mixing old and new versions.
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        rc, output = _run_maven(pom, out_dir, props, cache_dir)
        if rc == 0:
            jars = sorted(out_dir.glob("*.jar"))
            if not jars:
                raise InfraError(f"maven succeeded but copied no jars into {out_dir}; check {pom}")
            stamp = {
                "format": STAMP_FORMAT,
                "requested": dict(requested),
                "versions": dict(props),
                "inputs": inputs,
                "jars": [j.name for j in jars],
            }
            (out_dir / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
            log(f"{bundle}: {len(jars)} jars resolved")
            return Resolved(bundle, jars, dict(props), fetched=True)
        failure = _maven_error(bundle, rc, output)
        if i + 1 < len(attempts) and retry_if(output):
            log(f"{bundle}: not resolvable with {shown}; trying the next fallback")
            continue
        break
    assert failure is not None
    raise failure


def fetch_kafka(
    cache_dir: Path = CACHE_DIR, *, kafka_version: str = KAFKA_VERSION, log: Log = _stderr_log
) -> Resolved:
    """Kafka broker classpath (kafka_2.13 + runtime deps + log4j2 binding), fetched if not cached."""
    requested = {"kafka.version": kafka_version}
    return _resolve("kafka", requested, [requested], cache_dir, log)


def fetch_spark_kafka(
    cache_dir: Path = CACHE_DIR, *, spark_version: str = SPARK_KAFKA_VERSION, log: Log = _stderr_log
) -> Resolved:
    """spark-sql-kafka-0-10 ``spark_version`` (+ runtime deps), fetched if not cached.

    Returns every resolved jar; use spark_kafka_jars() for the list to put on spark.jars.
    """
    version = spark_version
    installed = pyspark_version()
    if installed.split(".")[0] != version.split(".")[0]:
        raise InfraError(
            f"pyspark {installed} cannot run the Spark-Kafka connector {version}: their major versions "
            "differ (see SPARK_KAFKA_VERSION in infra/artifacts/fetch.py)"
        )
    requested = {"spark.version": version}
    attempts = [
        {"spark.version": version, "spark.token.provider.version": v}
        for v in (version, *TOKEN_PROVIDER_FALLBACKS)
    ]

    def token_provider_missing(output: str) -> bool:
        # The second phrasing is what Maven says once the miss is cached in the local repository.
        missing = ("Could not find artifact", "was not found in", "Failed to read artifact descriptor")
        return "spark-token-provider-kafka" in output and any(m in output for m in missing)

    resolved = _resolve("spark-kafka", requested, attempts, cache_dir, log, retry_if=token_provider_missing)
    used = resolved.versions.get("spark.token.provider.version", version)
    if resolved.fetched and used != version:
        log(
            f"warning: spark-token-provider-kafka-0-10 {version} is not on Maven Central here; "
            f"using {used} (API-compatible for non-Kerberos use)"
        )
    return resolved


def kafka_classpath(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> list[Path]:
    """Jars for running the Kafka broker and its tools (java -cp), fetching first if needed."""
    return fetch_kafka(cache_dir, log=log).jars


def spark_kafka_jars(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> list[Path]:
    """Jars to add to a SparkSession (spark.jars) for format("kafka"), fetching first if needed.

    Jars whose artifact pyspark already ships (scala-library, slf4j-api, snappy-java, ...) are left out,
    so the session's classpath has exactly one version of each.
    """
    return exclude_shipped(fetch_spark_kafka(cache_dir, log=log).jars, pyspark_jars_dir())


def fetch_spark_avro(
    cache_dir: Path = CACHE_DIR, *, spark_version: str = SPARK_KAFKA_VERSION, log: Log = _stderr_log
) -> Resolved:
    """spark-avro ``spark_version`` (from_avro / to_avro), fetched if not cached. The wire-format bench
    measures Avro with it; no service uses it."""
    requested = {"spark.version": spark_version}
    return _resolve("spark-avro", requested, [requested], cache_dir, log)


def spark_avro_jars(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> list[Path]:
    """Jars to add to a SparkSession for Spark's Avro functions, without those pyspark ships
    (avro itself, scala-library)."""
    return exclude_shipped(fetch_spark_avro(cache_dir, log=log).jars, pyspark_jars_dir())


def fetch_zipkin(
    cache_dir: Path = CACHE_DIR, *, zipkin_version: str = ZIPKIN_VERSION, log: Log = _stderr_log
) -> Resolved:
    """Zipkin's exec jar (the whole server in one jar), fetched if not cached."""
    requested = {"zipkin.version": zipkin_version}
    return _resolve("zipkin", requested, [requested], cache_dir, log)


def zipkin_jar(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> Path:
    """Path of zipkin-server-<v>-exec.jar, fetching it first if needed."""
    jars = [j for j in fetch_zipkin(cache_dir, log=log).jars if j.name.startswith("zipkin-server-")]
    if len(jars) != 1:
        where = jars_dir("zipkin", cache_dir)
        raise InfraError(f"expected one zipkin-server exec jar in {where}, got {[j.name for j in jars]}")
    return jars[0]


def fetch_hdfs(
    cache_dir: Path = CACHE_DIR, *, hadoop_version: str = HADOOP_VERSION, log: Log = _stderr_log
) -> Resolved:
    """hadoop-hdfs and hadoop-common ``hadoop_version`` with their runtime deps, fetched if not cached."""
    requested = {"hadoop.version": hadoop_version}
    return _resolve("hdfs", requested, [requested], cache_dir, log)


def hdfs_classpath(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> list[Path]:
    """Jars for running a NameNode or DataNode (java -cp), fetching first if needed."""
    return fetch_hdfs(cache_dir, log=log).jars


# Every bundle `python -m infra fetch` (and so `make setup`) resolves, by name, in order.
BUNDLES: tuple[tuple[str, Callable[..., Resolved]], ...] = (
    ("kafka", fetch_kafka),
    ("spark-kafka", fetch_spark_kafka),
    ("spark-avro", fetch_spark_avro),
    ("zipkin", fetch_zipkin),
    ("hdfs", fetch_hdfs),
)
