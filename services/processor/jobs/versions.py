"""Result versions: ``epoch * 2**32 + n``, strictly growing per window of a job.

``n`` is the rows the window has aggregated so far: each update of a window follows at least one more
row, and a batch replayed after a crash emits the same versions again, which a sink refuses as not
newer. It is computed inside the query, per row, in both trigger modes. Micro-batch checkpoints
written before row counts keep ``n`` = the micro-batch id (``BATCH_VERSIONS``). Every start from a
savepoint takes an epoch above any the job id has used (kept in the job ledger and the checkpoint), so
even an *older* savepoint's restore emits versions above everything before. Versions stay below 2**53
so that JSON readers and Redis's Lua (doubles) compare them exactly: 2**21 epochs, 2**32 rows each.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

from services.processor.errors import ProcessorError
from shared.fences import EPOCH_SHIFT

BATCH_BITS = EPOCH_SHIFT
MAX_EPOCH = 2**21 - 1
MAX_BATCH_ID = 2**BATCH_BITS - 1
# How a checkpoint's windows are versioned (kept in the processor's note in the checkpoint).
ROW_VERSIONS = "rows"  # epoch * 2**32 + the rows the window aggregated: every checkpoint started now
BATCH_VERSIONS = "batch"  # epoch * 2**32 + the micro-batch id: micro-batch checkpoints of before


def version_of(epoch: int, batch_id: int) -> int:
    if not 0 <= epoch <= MAX_EPOCH:
        raise ProcessorError(f"epoch {epoch} is outside 0..{MAX_EPOCH}")
    if not 0 <= batch_id <= MAX_BATCH_ID:
        raise ProcessorError(f"batch id {batch_id} is outside 0..{MAX_BATCH_ID}")
    return (epoch << BATCH_BITS) | batch_id


def version_column(epoch: int, rows: Column) -> Column:
    """A window's version: the epoch above the window's row count (capped to 32 bits)."""
    base = version_of(epoch, 0)
    return F.lit(base).cast("long") + F.least(rows.cast("long"), F.lit(MAX_BATCH_ID).cast("long"))


def split_version(version: int) -> tuple[int, int]:
    """version -> (epoch, the window's row count; the batch id under BATCH_VERSIONS)."""
    return version >> BATCH_BITS, version & MAX_BATCH_ID
