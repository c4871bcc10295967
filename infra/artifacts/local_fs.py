"""The processor's local file system for Hadoop (ForklessLocalFileSystem.java in
services/processor/spark/java/), compiled once per source and pyspark into CACHE_DIR/local-fs/.

Hadoop without its native library (pyspark ships none) runs `chmod` in a new process for every file
it creates on a local path; the class sets those permissions through java.nio instead. It is compiled
against pyspark's own Hadoop jar, and the jar's name carries a digest of the source and that Hadoop
jar, so a change of either makes a new one. The processor puts it on its driver's class path
(``SF_PROCESSOR_LOCAL_FS_JAR``, filled by infra).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from infra.artifacts.fetch import Log, pyspark_jars_dir, require_tool
from infra.errors import InfraError
from infra.paths import CACHE_DIR, ROOT, digest_named, existing

SOURCE = ROOT / "services/processor/spark/java/io/streamforge/hadoop/ForklessLocalFileSystem.java"
JAVA_RELEASE = "17"
COMPILE_TIMEOUT_S = 300


def _stderr_log(msg: str) -> None:
    print(f"[infra.artifacts.local_fs] {msg}", file=sys.stderr)


def hadoop_api_jar() -> Path:
    """pyspark's Hadoop client API jar (the classes the source extends)."""
    found = sorted(pyspark_jars_dir().glob("hadoop-client-api-*.jar"))
    if not found:
        raise InfraError(f"no hadoop-client-api jar in {pyspark_jars_dir()}; reinstall pyspark")
    return found[-1]


def jar_path(cache_dir: Path = CACHE_DIR) -> Path:
    key = [SOURCE.read_text(encoding="utf-8"), hadoop_api_jar().name, JAVA_RELEASE]
    return digest_named(cache_dir / "local-fs", "streamforge-local-fs", key, ".jar")


def ensure_local_fs_jar(cache_dir: Path = CACHE_DIR, *, log: Log = _stderr_log) -> tuple[Path, bool]:
    """The jar for this source and pyspark, compiled when missing; (path, made now)."""
    path = jar_path(cache_dir)
    if path.is_file():
        return path, False
    javac = require_tool("javac", "install a JDK 17+ (Debian: apt-get install -y openjdk-17-jdk-headless)")
    log(f"compiling {SOURCE.name} into {path.name} (once per source and pyspark)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sf-local-fs-") as tmp:
        classes = Path(tmp) / "classes"
        cmd = [javac, "--release", JAVA_RELEASE, "-cp", str(hadoop_api_jar()), "-d", str(classes)]
        cmd.append(str(SOURCE))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise InfraError(f"javac took over {COMPILE_TIMEOUT_S} s") from e
        if done.returncode != 0:
            raise InfraError(f"javac failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
        partial = path.with_name(path.name + ".partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
            for f in sorted(classes.rglob("*.class")):
                jar.write(f, f.relative_to(classes).as_posix())
        partial.replace(path)
    return path, True


def existing_local_fs_jar(cache_dir: Path = CACHE_DIR) -> str:
    """The jar's path when set-up made it, else "" (the processor then uses Hadoop's own)."""
    return existing(jar_path(cache_dir))
