"""Silent streams: their event time follows processing time, so their last windows close.

Once every partition of a stream has been silent for the shortest idle timeout of the jobs that read
it, ingest writes a watermark advance (shared/packs.py ``advance_record``) to every partition of its
``.valid`` topic: the last event time seen plus the silence, never past now, with the silence's
length, so each job takes only those past its own timeout. It goes in a transaction that also
commits the owned partitions' offsets with their state, as a batch does: after a crash, ingest's late
rule and what the jobs saw agree. Advances repeat every ``silence_advance_interval_ms`` until every
window of the stream's jobs is behind them (``watermark.IdlePolicy``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaException

from services.ingest.pipeline import Pipeline
from services.ingest.streams import StreamDefinition
from services.ingest.transactions import Transactions
from services.ingest.watermark import Advance, StreamWatermark

log = logging.getLogger(__name__)


def due_advances(watermarks: Mapping[str, StreamWatermark], now_ms: int, interval_ms: int) -> list[Advance]:
    """The advances due now, one per silent stream that has one to write."""
    due = (w.due_advance(topic, now_ms, interval_ms) for topic, w in watermarks.items())
    return [a for a in due if a is not None]


def advance_silent_streams(
    pipeline: Pipeline,
    transactions: Transactions,
    streams: dict[str, StreamDefinition],
    watermarks: dict[str, StreamWatermark],
    now_ms: int,
    consumer: Consumer,
    interval_ms: int,
) -> list[Advance]:
    """Write the advances due now in one transaction; on an abortable error nothing is kept (the next
    call tries again). Returns the advances committed."""
    advances = due_advances(watermarks, now_ms, interval_ms)
    if not advances:
        return []
    snapshot = {a.topic: watermarks[a.topic].snapshot() for a in advances}
    try:
        pipeline.advance(advances, streams, watermarks, now_ms, consumer)
    except KafkaException as e:
        transactions.abort(e, 0)  # raises FatalKafkaError when only a restart is safe
        for topic, snap in snapshot.items():
            watermarks[topic].rollback(snap)
        return []
    log.debug("advanced silent streams: %s", advances)
    return advances
