"""What the JVMs infra starts (Kafka, Zipkin, Spark's daemons) are given: memory sizes, checked before
they start, and a temporary directory of their own.

A size is given with a unit ("448m", "1g"): the JVM reads "512" as bytes and would refuse to start,
into a log nobody reads yet (shared.jvm.memory_mib, the same rule as the processor's driver heap).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from infra.errors import InfraError
from shared.jvm import memory_mib


def checked_memory(size: str, what: str) -> str:
    """``size`` as the JVM or Spark takes it; an InfraError naming ``what`` if it has no unit."""
    try:
        memory_mib(size)
    except ValueError as e:
        raise InfraError(f"bad memory size for {what}: {e}") from None
    return size.strip()


def private_tmpdir(path: Path) -> str:
    """``-Djava.io.tmpdir`` for a JVM about to start, at ``path``, emptied first.

    lz4-java and snappy-java extract their native libraries there (``/tmp/liblz4-java-*.so``) and
    delete them in a shutdown hook, which a SIGKILLed JVM never runs, so the chaos and recovery runs,
    which kill brokers, would fill /tmp. Here the next start of the same JVM removes them.
    Only for a JVM that is not running (its caller checked), as its open files would go too.
    """
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return f"-Djava.io.tmpdir={path}"
