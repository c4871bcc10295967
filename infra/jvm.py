"""Memory sizes for the JVMs infra starts (Kafka, Zipkin, Spark's daemons), checked before they start.

A size is given with a unit ("448m", "1g"): the JVM reads "512" as bytes and would refuse to start,
into a log nobody reads yet (shared.jvm.memory_mib, the same rule as the processor's driver heap).
"""

from __future__ import annotations

from infra.errors import InfraError
from shared.jvm import memory_mib


def checked_memory(size: str, what: str) -> str:
    """``size`` as the JVM or Spark takes it; an InfraError naming ``what`` if it has no unit."""
    try:
        memory_mib(size)
    except ValueError as e:
        raise InfraError(f"bad memory size for {what}: {e}") from None
    return size.strip()
