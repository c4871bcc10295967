"""Result versions: ``epoch * 2**32 + batch_id``, strictly growing per window of a job.

In real-time mode (no foreachBatch, and one long batch holds many updates of a window) the low 32
bits are instead the number of rows the window has aggregated so far: each update of a window follows
at least one more row, and a replay after a crash aggregates the same rows in the same order per
partition, so it emits the same versions again. The high bits are the epoch, as below.

- Within one checkpoint, batch ids only grow, and a batch replayed after a crash keeps its id and
  its rows: a replay produces the same versions, which a sink refuses as not newer.
- Every start from a savepoint takes a new epoch, higher than any epoch the job id has used (the
  processor keeps the highest in its job store and in the checkpoint), so even a restore of an
  *older* savepoint, whose batch ids start lower again, emits versions above everything before.

Versions stay below 2**53 so that every JSON reader and Redis's Lua (doubles) compare them exactly:
that leaves 2**21 epochs and 2**32 batches per epoch (136 years at one batch per second).
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

from services.processor.errors import ProcessorError

BATCH_BITS = 32
MAX_EPOCH = 2**21 - 1
MAX_BATCH_ID = 2**BATCH_BITS - 1


def version_of(epoch: int, batch_id: int) -> int:
    if not 0 <= epoch <= MAX_EPOCH:
        raise ProcessorError(f"epoch {epoch} is outside 0..{MAX_EPOCH}")
    if not 0 <= batch_id <= MAX_BATCH_ID:
        raise ProcessorError(f"batch id {batch_id} is outside 0..{MAX_BATCH_ID}")
    return (epoch << BATCH_BITS) | batch_id


def version_column(epoch: int, rows: Column) -> Column:
    """Real-time mode's version: the epoch above the window's row count (capped to 32 bits)."""
    base = version_of(epoch, 0)
    return F.lit(base).cast("long") + F.least(rows.cast("long"), F.lit(MAX_BATCH_ID).cast("long"))


def split_version(version: int) -> tuple[int, int]:
    """version -> (epoch, batch id)."""
    return version >> BATCH_BITS, version & MAX_BATCH_ID
