"""The JDK Spark runs on: the newest installed one with an ahead-of-time cache, else the `java` on PATH.

JDK 25's AOT cache (JEPs 483, 514 and 515) holds a training run's classes loaded and linked and its
methods' profiles, so a processor (re)starting maps them and compiles its hot code sooner; JDK 17's
class-data-sharing archive holds parsed classes only. Kafka, HDFS and Zipkin keep the `java` on PATH.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

# The first JDK whose `-XX:AOTCacheOutput` trains and writes the cache in one run.
AOT_CACHE_JDK = 25
JVM_DIR = Path("/usr/lib/jvm")
_VERSION = re.compile(r'version "(\d+)')


@functools.cache
def feature_version(java: str) -> int:
    """The feature release of ``java`` (17 for "17.0.15"); 0 when it does not run."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return 0
    match = _VERSION.search(out)
    return int(match.group(1)) if match else 0


@functools.cache
def spark_java_home(jvm_dir: Path = JVM_DIR) -> str:
    """The home of the newest JDK under ``jvm_dir`` that has the AOT cache, or "" (Spark then runs on
    JAVA_HOME or the `java` on PATH)."""
    found = [
        (feature_version(str(home / "bin" / "java")), str(home))
        for home in sorted(jvm_dir.glob("*"))
        if (home / "bin" / "java").is_file() and not home.is_symlink()
    ]
    usable = [(version, home) for version, home in found if version >= AOT_CACHE_JDK]
    return max(usable)[1] if usable else ""


def java_of(java_home: str) -> str:
    """The `java` launcher of ``java_home`` ("" : the one on PATH)."""
    return str(Path(java_home) / "bin" / "java") if java_home else "java"
