"""JVM settings that more than one place reads: a heap size as the JVM reads it.

A heap size is given with a unit ("768m", "1g"). The JVM reads a number without one as bytes and Spark
reads it as MiB, so "512" is refused rather than read either way.
"""

from __future__ import annotations

import re

_MEMORY = re.compile(r"(\d+)([kmgt])", re.IGNORECASE)
_MIB_PER_UNIT = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024**2}


def memory_mib(value: str) -> float:
    """``value`` ("768m", "1g") in MiB; a ValueError for anything without a unit."""
    match = _MEMORY.fullmatch(value.strip())
    if not match:
        raise ValueError(f"{value!r} is not a heap size with a unit, such as 768m or 1g")
    return int(match[1]) * _MIB_PER_UNIT[match[2].lower()]
