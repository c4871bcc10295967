"""The four services' container images and HDFS's, built with podman from this project's own files.

No container registry is needed: the base image is made from Debian packages (``mmdebstrap`` piped
into ``podman import``), every layer above it from requirements.lock, the Spark-Kafka jars and the
code. The chain, each a ``localhost/streamforge/...`` image:

    debian:bookworm    minbase + python3, python3-venv, ca-certificates, curl (podman's kube probes)
    python:<version>   user ``streamforge`` (uid 10001), /opt/venv with the run-time dependencies
                       (containers/python.Containerfile)
    spark:<version>    + Java 17, pyspark, the Spark-Kafka jars and the processor's local file
                       system jar (containers/spark.Containerfile)
    ingest, sink, control:<version>   python + shared/ + services/<name>/ (services/<name>/Containerfile)
    processor:<version>               spark  + shared/ + services/processor/
    hdfs:<version>                    python + Java 17, the hadoop-hdfs jars and infra/local/hdfs.py
                                      (containers/hdfs.Containerfile): the processor's state in Kubernetes

Each image carries the label ``io.streamforge.inputs``, a digest of everything it is built from (its
parent's digest, its Containerfile, the files it copies): an image whose label matches is not built
again, and podman's layer cache skips the unchanged steps of one that is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.artifacts import apt
from infra.artifacts.fetch import hdfs_classpath, spark_kafka_jars
from infra.artifacts.local_fs import ensure_local_fs_jar
from infra.errors import InfraError
from infra.images.podman import PODMAN, ULIMITS, podman, podman_env, run_podman
from infra.images.requirements import runtime_requirements
from infra.paths import CACHE_DIR, ROOT

Log = Callable[[str], None]

REGISTRY = "localhost/streamforge"
LABEL = "io.streamforge.inputs"
CONTAINERS_DIR = Path(__file__).resolve().parent / "containers"
CONTEXT_DIR = CACHE_DIR / "images" / "context"
DIST_INFO_DIR = "dist-info"  # in the context: the project's metadata (_stage_dist_info)
SERVICES = ("ingest", "processor", "sink", "control")
# Every image `make images` builds: the services' and HDFS's.
IMAGES = (*SERVICES, "hdfs")
# What the hdfs image runs: infra/local/hdfs.py and the modules it imports, nothing else of infra/.
HDFS_MODULES = (
    "infra/__init__.py",
    "infra/errors.py",
    "infra/paths.py",
    "infra/artifacts/__init__.py",
    "infra/artifacts/fetch.py",
    "infra/local/__init__.py",
    "infra/local/hdfs.py",
    "infra/local/jvm.py",
    "infra/local/procs.py",
    "shared/__init__.py",
    "shared/jvm.py",
)

# What the Debian base image holds: Python 3.11 (bookworm's), venv, CA roots; curl lets podman's
# kube play run httpGet probes inside the container.
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates", "curl")

# Where things are inside the images (the manifests and the container tests use the same paths).
APP_DIR = "/opt/streamforge/app"
JARS_DIR = "/opt/streamforge/jars"
LOCAL_FS_DIR = "/opt/streamforge/local-fs"
DATA_DIR = "/var/lib/streamforge"
TLS_DIR = "/etc/streamforge/tls"
USER_UID = 10001

# The build machine's CA bundle, given to pip inside the build (an HTTPS proxy this machine trusts).
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def _stderr_log(msg: str) -> None:
    print(f"[infra.images] {msg}", file=sys.stderr)


def version() -> str:
    return importlib.metadata.version("streamforge")


def image_name(name: str, tag: str | None = None) -> str:
    return f"{REGISTRY}/{name}:{tag or version()}"


def service_image(service: str) -> str:
    return image_name(service)


def ensure_tools(log: Log = _stderr_log) -> None:
    """podman, runc, mmdebstrap and catatonit, installed from Debian when missing (needs root)."""
    for tool in (apt.PODMAN, apt.RUNC, apt.MMDEBSTRAP, apt.CATATONIT):
        tool.ensure_installed(log)


def _code_files() -> list[Path]:
    """The files the service images copy: shared/ and services/ (not the CLI and SDK in client/)."""
    files = []
    for top in ("shared", "services"):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".md"):
                continue
            if path.name == "build.py" and rel.parts[1] == "proto":
                continue
            files.append(path)
    return files


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def _file_parts(root: Path, files: Iterable[Path]) -> Iterator[bytes]:
    for f in files:
        yield str(f.relative_to(root)).encode()
        yield f.read_bytes()


@dataclass(frozen=True)
class ImageSpec:
    """One image: its reference, Containerfile, parent image, build arguments and inputs digest."""

    ref: str
    containerfile: Path
    parent: str
    inputs: str
    build_args: tuple[tuple[str, str], ...] = ()

    @property
    def pinned(self) -> str:
        """A tag naming these inputs: what a test or a child image uses, whatever another checkout
        of the project builds under the version tag meanwhile."""
        return pinned_ref(self.ref, self.inputs)


def pinned_ref(ref: str, inputs: str) -> str:
    return f"{ref.rsplit(':', 1)[0]}:in-{inputs[:16]}"


def _stage_dist_info(directory: Path) -> list[Path]:
    """The project's distribution metadata as an install would write it (name, version, entry points):
    the images copy the code, not install it, yet must find the shipped operators by entry point."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    d = directory / f"{project['name']}-{project['version']}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project.get("entry-points", {})
    (d / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in sorted(eps.items())) + "\n"
            for group, eps in sorted(groups.items())
        )
    )
    return sorted(d.iterdir())


def stage_context(context: Path = CONTEXT_DIR, log: Log = _stderr_log) -> dict[str, ImageSpec]:
    """Copy what the images are built from into ``context``; returns the images in build order."""
    generated = ROOT / "shared" / "proto" / "streamforge_pb2.py"
    if not generated.exists():
        raise InfraError(f"{generated} is missing: run `make setup` (python -m shared.proto.build) first")
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    base, spark = runtime_requirements((ROOT / "requirements.lock").read_text())
    (context / "requirements-runtime.txt").write_text("\n".join(base) + "\n")
    (context / "requirements-spark.txt").write_text("\n".join(spark) + "\n")
    code = _code_files()
    for f in code:
        dest = context / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    jars = spark_kafka_jars(log=log)
    (context / "jars").mkdir()
    for jar in jars:
        shutil.copy2(jar, context / "jars" / jar.name)
    # The processor's local file system (infra/artifacts/local_fs.py): on the driver's class path, not in
    # spark.jars, so a folder of its own. Compiled for Java 17 against pyspark's Hadoop jar, the
    # one the image installs too (the same requirements.lock).
    local_fs, _ = ensure_local_fs_jar(log=log)
    (context / "local-fs").mkdir()
    shutil.copy2(local_fs, context / "local-fs" / local_fs.name)
    (context / "hdfs-jars").mkdir()
    for jar in hdfs_classpath(log=log):
        shutil.copy2(jar, context / "hdfs-jars" / jar.name)
    for module in HDFS_MODULES:
        dest = context / "hdfs-app" / module
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / module, dest)

    dist_info = _stage_dist_info(context / DIST_INFO_DIR)

    def cf(path: Path) -> bytes:
        return path.read_bytes()

    debian = _digest([DEBIAN_SUITE.encode(), *(p.encode() for p in DEBIAN_PACKAGES)])
    python_cf = CONTAINERS_DIR / "python.Containerfile"
    spark_cf = CONTAINERS_DIR / "spark.Containerfile"
    python = _digest([debian.encode(), cf(python_cf), "\n".join(base).encode()])
    spark_digest = _digest(
        [
            python.encode(),
            cf(spark_cf),
            "\n".join(spark).encode(),
            *_file_parts(context, (context / "jars").iterdir()),
            *_file_parts(context, (context / "local-fs").iterdir()),
        ]
    )
    shared_files = [context / f.relative_to(ROOT) for f in code if f.relative_to(ROOT).parts[0] == "shared"]
    jar_paths = json.dumps([f"{JARS_DIR}/{j.name}" for j in jars])
    debian_spec = ImageSpec(image_name("debian", DEBIAN_SUITE), Path(), "", debian)
    python_spec = ImageSpec(image_name("python"), python_cf, debian_spec.pinned, python)
    specs = {
        "debian": debian_spec,
        "python": python_spec,
        "spark": ImageSpec(
            image_name("spark"),
            spark_cf,
            python_spec.pinned,
            spark_digest,
            (("SPARK_JARS", jar_paths), ("LOCAL_FS_JAR", f"{LOCAL_FS_DIR}/{local_fs.name}")),
        ),
    }
    for service in SERVICES:
        parent = specs["spark" if service == "processor" else "python"]
        own = [
            context / f.relative_to(ROOT)
            for f in code
            if f.relative_to(ROOT).parts[:2] == ("services", service)
        ]
        containerfile = ROOT / "services" / service / "Containerfile"
        digest = _digest(
            [
                parent.inputs.encode(),
                cf(containerfile),
                *_file_parts(
                    context, [*shared_files, *dist_info, context / "services" / "__init__.py", *own]
                ),
            ]
        )
        specs[service] = ImageSpec(service_image(service), containerfile, parent.pinned, digest)
    hdfs_cf = CONTAINERS_DIR / "hdfs.Containerfile"
    hdfs_digest = _digest(
        [
            python.encode(),
            cf(hdfs_cf),
            *_file_parts(context, sorted((context / "hdfs-jars").iterdir())),
            *_file_parts(context, sorted((context / "hdfs-app").rglob("*.py"))),
        ]
    )
    specs["hdfs"] = ImageSpec(image_name("hdfs"), hdfs_cf, python_spec.pinned, hdfs_digest)
    return specs


def image_label(ref: str) -> str | None:
    """The inputs digest an existing image was built from, or None when there is no such image."""
    proc = run_podman(["image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', ref])
    return proc.stdout.strip() if proc.returncode == 0 else None


def image_size_mb(ref: str) -> float:
    return int(podman(["image", "inspect", "--format", "{{.Size}}", ref]).strip()) / 1e6


def _import_debian(spec: ImageSpec, log: Log) -> None:
    ref = spec.pinned
    log(f"making {spec.ref} with mmdebstrap ({', '.join(DEBIAN_PACKAGES)})")
    debootstrap = subprocess.Popen(
        [
            "mmdebstrap",
            "--quiet",
            "--variant=minbase",
            f"--include={','.join(DEBIAN_PACKAGES)}",
            DEBIAN_SUITE,
            "-",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    imported = subprocess.run(
        [*PODMAN, "import", "--change", f"LABEL {LABEL}={spec.inputs}", "-", ref],
        stdin=debootstrap.stdout,
        capture_output=True,
        text=True,
        check=False,
        env=podman_env(),
    )
    assert debootstrap.stdout is not None and debootstrap.stderr is not None
    debootstrap.stdout.close()
    err = debootstrap.stderr.read().decode(errors="replace")
    if debootstrap.wait() != 0 or imported.returncode != 0:
        raise InfraError(f"making the Debian base image failed:\n{err[-2000:]}\n{imported.stderr[-2000:]}")


def _build(spec: ImageSpec, context: Path, log: Log) -> None:
    log(f"building {spec.ref} from {spec.containerfile.relative_to(ROOT)}")
    args = [
        "build",
        "--layers",
        "--network",
        "host",
        *(["--secret", f"id=build-ca,src={HOST_CA_BUNDLE}"] if HOST_CA_BUNDLE.exists() else []),
        *ULIMITS,
        *(a for k, v in (("BASE", spec.parent), *spec.build_args) for a in ("--build-arg", f"{k}={v}")),
        "--label",
        f"{LABEL}={spec.inputs}",
        "-f",
        str(spec.containerfile),
        "-t",
        spec.pinned,
        str(context),
    ]
    proc = subprocess.run([*PODMAN, *args], capture_output=True, text=True, check=False, env=podman_env())
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise InfraError(f"building {spec.ref} failed (exit {proc.returncode}):\n{tail}")


@dataclass(frozen=True)
class Built:
    ref: str
    pinned: str  # the same image, tagged with its inputs digest
    built: bool  # False: the image with these inputs existed (the stamp matched)
    seconds: float
    size_mb: float


def build_all(names: Sequence[str] = IMAGES, log: Log = _stderr_log) -> list[Built]:
    """The base images and the ``names`` images, each built only when its inputs changed."""
    ensure_tools(log)
    specs = stage_context(log=log)
    wanted = ["debian", "python", *(["spark"] if "processor" in names else []), *names]
    results = []
    for name in wanted:
        spec = specs[name]
        t0 = time.monotonic()
        fresh = image_label(spec.pinned) != spec.inputs
        if fresh:
            if name == "debian":
                _import_debian(spec, log)
            else:
                _build(spec, CONTEXT_DIR, log)
        podman(["tag", spec.pinned, spec.ref])  # the version tag: what the manifests name
        results.append(Built(spec.ref, spec.pinned, fresh, time.monotonic() - t0, image_size_mb(spec.pinned)))
        log(f"{spec.pinned}: {'built' if fresh else 'up to date'} ({results[-1].size_mb:.0f} MB)")
    return results


def prune(keep: Iterable[str], log: Log = _stderr_log) -> list[str]:
    """Remove this project's images (label io.streamforge.inputs) other than ``keep``: older builds
    under their inputs tag, and untagged ones. An image a container still uses stays."""
    keep_ids = {podman(["image", "inspect", "--format", "{{.Id}}", ref]).strip() for ref in keep}
    listed = podman(["images", "--all", "--filter", f"label={LABEL}", "--format", "{{.Id}}"]).split()
    removed = []
    for image_id in dict.fromkeys(listed):
        if any(k.startswith(image_id) or image_id.startswith(k) for k in keep_ids):
            continue
        if run_podman(["rmi", image_id]).returncode == 0:
            removed.append(image_id[:12])
    log(f"removed {len(removed)} older images" if removed else "no older images to remove")
    return removed
