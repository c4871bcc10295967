"""Result versions: ``epoch * 2**32 + n``, strictly growing per window of a job.

``n`` is the number of rows the window has aggregated so far. Spark emits a window only when rows
were added to it (update mode) or once, when it closes (append mode), so each update of a window
follows at least one more row; a batch replayed after a crash reads the same offsets, aggregates
the same rows and emits the same versions again, which a sink refuses as not newer. The count is
part of the aggregation, so the version is computed inside the query, per row, in both trigger
modes: no per-batch literal and no foreachBatch round trip through the Python driver.

Checkpoints written before that (micro-batch jobs only) keep their own scheme, ``n`` = the
micro-batch id, passed in by foreachBatch: their state holds no row count (``BATCH_VERSIONS``).

- Every start from a savepoint takes a new epoch, higher than any epoch the job id has used (the
  processor keeps the highest in its job store and in the checkpoint), so even a restore of an
  *older* savepoint, whose counts (or batch ids) start lower again, emits versions above everything
  before.

Versions stay below 2**53 so that every JSON reader and Redis's Lua (doubles) compare them exactly:
that leaves 2**21 epochs and 2**32 rows (or batches) per window and epoch.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F

from services.processor.errors import ProcessorError

BATCH_BITS = 32
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
