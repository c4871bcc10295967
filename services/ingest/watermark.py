"""Event-time watermarks per stream, tracked per partition of its raw topic (pure, no I/O).

An event is late when its event time is before its own partition's watermark (the largest event time
seen there minus the out-of-orderness) minus the allowed lateness, as Kafka Streams' stream time: the
late set depends only on each partition's own events, whatever the batches, interleaving or crashes.
The stream's watermark, the published one, is the smallest of its active partitions' (one idle for
``idle_timeout_ms`` does not hold it back; other replicas' are known from their commits); it never
goes backwards and decides no lateness. Once every partition is silent for the stream's idle policy,
``due_advance`` says how far event time has followed processing time (services/ingest/silence.py).
Time is an argument (``now_ms``), so tests set "now".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import orjson

METADATA_VERSION = 1


@dataclass(slots=True)
class PartitionProgress:
    """What a partition contributes to its stream's watermark; committed with the partition's offset."""

    max_event_time_ms: int | None = None  # None: no event seen yet
    last_record_ms: int = 0  # processing time of the partition's last record (idleness)
    stream_watermark_ms: int | None = None  # the stream's watermark when this was committed
    advanced_ms: int | None = None  # event time a silence advanced it to (late events judged against it)
    offset: int | None = None  # the offset committed last (not in the metadata: it is the offset)

    def to_metadata(self) -> str:
        """Compact JSON for the offset commit's metadata field (Kafka keeps up to 4 KiB there)."""
        doc = {
            "v": METADATA_VERSION,
            "max": self.max_event_time_ms,
            "seen": self.last_record_ms,
            "swm": self.stream_watermark_ms,
        }
        if self.advanced_ms is not None:
            doc["adv"] = self.advanced_ms
        return orjson.dumps(doc).decode()

    @property
    def event_time_ms(self) -> int | None:
        """How far event time went on this partition: its largest event time, or a later advance."""
        if self.advanced_ms is None or self.max_event_time_ms is None:
            return self.max_event_time_ms if self.advanced_ms is None else self.advanced_ms
        return max(self.max_event_time_ms, self.advanced_ms)

    @classmethod
    def from_metadata(cls, text: str | None) -> PartitionProgress | None:
        """The progress committed with an offset; None when there is none or it is not ours."""
        if not text:
            return None
        try:
            doc: Any = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(doc, dict) or doc.get("v") != METADATA_VERSION:
            return None
        max_ts, seen, swm, adv = doc.get("max"), doc.get("seen"), doc.get("swm"), doc.get("adv")
        if not all(
            x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in (max_ts, seen, swm, adv)
        ):
            return None
        return cls(
            max_event_time_ms=max_ts, last_record_ms=seen or 0, stream_watermark_ms=swm, advanced_ms=adv
        )


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    """When a silent stream's event time follows processing time, over the jobs that read it."""

    first_ms: int = 0  # the shortest idle timeout of its jobs: advances start then (0: never)
    last_ms: int = 0  # the longest: every job has taken an advance once the silence passed it
    lenient_ms: int = 0  # ingest's own late rule takes advances after this (0: a job never does)
    horizon_ms: int = 0  # event time past the last event at which every window has closed


@dataclass(frozen=True, slots=True)
class Advance:
    """A silent stream's event time, ``event_time_ms``, after ``silent_ms`` of silence."""

    topic: str
    event_time_ms: int
    silent_ms: int


@dataclass(frozen=True, slots=True)
class WatermarkSnapshot:
    owned: dict[int, PartitionProgress]
    watermark_ms: int | None
    advanced: tuple[int, int, int, int] | None


class StreamWatermark:
    def __init__(
        self,
        max_out_of_orderness_ms: int,
        allowed_lateness_ms: int,
        idle_timeout_ms: int,
        idle: IdlePolicy = IdlePolicy(),
    ) -> None:
        self.max_out_of_orderness_ms = max_out_of_orderness_ms
        self.allowed_lateness_ms = allowed_lateness_ms
        self.idle_timeout_ms = idle_timeout_ms
        self.idle = idle
        self.owned: dict[int, PartitionProgress] = {}
        self.remote: dict[int, PartitionProgress] = {}
        self.watermark_ms: int | None = None
        # The last advance written: (its silence's last record time, event time, silent ms, written at).
        self.advanced: tuple[int, int, int, int] | None = None

    # --- which partitions count -----------------------------------------------------------------
    def assign(
        self, partition: int, restored: PartitionProgress | None, now_ms: int, offset: int | None = None
    ) -> None:
        """Take a partition over, with the progress committed with its offset (None: fresh)."""
        progress = copy.copy(restored) if restored is not None else PartitionProgress()
        # Newly assigned counts as active: it may hold data we have not fetched yet.
        progress.last_record_ms = max(progress.last_record_ms, now_ms)
        progress.offset = offset
        self.owned[partition] = progress
        self.remote.pop(partition, None)
        if restored is not None and restored.stream_watermark_ms is not None:
            self._raise_to(restored.stream_watermark_ms)

    def revoke(self, partition: int) -> None:
        self.owned.pop(partition, None)

    def set_remote(self, partition: int, progress: PartitionProgress) -> None:
        """What another replica last committed for a partition it owns."""
        if partition not in self.owned:
            self.remote[partition] = progress

    # --- the watermark --------------------------------------------------------------------------
    def partition_watermark(self, progress: PartitionProgress) -> int | None:
        event_time = progress.event_time_ms
        return None if event_time is None else event_time - self.max_out_of_orderness_ms

    def is_idle(self, progress: PartitionProgress, now_ms: int) -> bool:
        return now_ms - progress.last_record_ms >= self.idle_timeout_ms

    def advance(self, now_ms: int) -> int | None:
        """Recompute the stream's watermark from its active partitions; it only ever moves forward."""
        lowest: int | None = None
        for progress in (*self.owned.values(), *self.remote.values()):
            if self.is_idle(progress, now_ms):
                continue
            mark = self.partition_watermark(progress)
            if mark is None:
                return self.watermark_ms  # an active partition without events yet holds everything
            lowest = mark if lowest is None else min(lowest, mark)
        if lowest is not None:
            self._raise_to(lowest)
        return self.watermark_ms

    def observe(self, partition: int, event_time_ms: int, now_ms: int) -> int | None:
        """Judge one event of an owned partition, then account for it.

        Returns the partition's watermark the event is late against, or None when it is on time.
        The stream's watermark is recomputed by ``advance``, once per batch, not per event.
        """
        progress = self.owned[partition]
        progress.last_record_ms = now_ms
        before = progress.event_time_ms
        if progress.max_event_time_ms is None or event_time_ms > progress.max_event_time_ms:
            progress.max_event_time_ms = event_time_ms
        if before is None or event_time_ms > before:
            return None
        mark = before - self.max_out_of_orderness_ms
        return mark if event_time_ms < mark - self.allowed_lateness_ms else None

    # --- silence ----------------------------------------------------------------------------------
    def due_advance(self, topic: str, now_ms: int, interval_ms: int) -> Advance | None:
        """The advance to write now, if every partition has been silent for the idle policy's first
        timeout and the last event arrived within that timeout of its event time (a live stream):
        event time goes on from the last event time seen as processing time does, never past now (a
        fresh event could not be later), until every window is behind it. One every ``interval_ms``
        at most; None when not due."""
        idle = self.idle
        parts = [*self.owned.values(), *self.remote.values()]
        if idle.first_ms <= 0 or not self.owned:
            return None
        seen = max(p.last_record_ms for p in parts)
        silent = now_ms - seen
        events = [p.max_event_time_ms for p in parts if p.max_event_time_ms is not None]
        if silent < idle.first_ms or not events:
            return None
        last = max(events)
        if seen - last > idle.first_ms:
            return None  # events that arrived this far behind their time: a replay, whose pauses say nothing
        event_time = min(last + silent, max(last, now_ms))
        done = self.advanced
        if done is not None and done[0] == seen:
            _, done_time, done_silent, written_at = done
            if now_ms - written_at < interval_ms or event_time <= done_time:
                return None
            if done_time - last >= idle.horizon_ms and done_silent >= idle.last_ms:
                return None  # every window has closed and every job has had its advance
        return Advance(topic, event_time, silent)

    def apply_advance(self, advance: Advance, now_ms: int) -> None:
        """Account for ``advance``, written in the transaction that commits the owned partitions' state;
        past the lenient timeout, ingest's late rule and published watermark follow it too."""
        seen = max(p.last_record_ms for p in (*self.owned.values(), *self.remote.values()))
        self.advanced = (seen, advance.event_time_ms, advance.silent_ms, now_ms)
        if self.idle.lenient_ms <= 0 or advance.silent_ms < self.idle.lenient_ms:
            return
        for progress in self.owned.values():
            if progress.advanced_ms is None or advance.event_time_ms > progress.advanced_ms:
                progress.advanced_ms = advance.event_time_ms
        self._raise_to(advance.event_time_ms - self.max_out_of_orderness_ms)

    def committed_progress(self, partition: int) -> PartitionProgress:
        """An owned partition's progress as it is committed with the partition's offset."""
        progress = copy.copy(self.owned[partition])
        progress.stream_watermark_ms = self.watermark_ms
        return progress

    def lag_ms(self, now_ms: int) -> int | None:
        """How far the watermark trails processing time (what `watermark_lag_ms` reports)."""
        return None if self.watermark_ms is None else now_ms - self.watermark_ms

    def describe(self, topic: str, now_ms: int) -> dict[str, object]:
        """The stream's watermark and each partition's part in it, as the HTTP endpoint shows it."""
        partitions = {
            **{p: ("remote", s) for p, s in self.remote.items()},
            **{p: ("owned", s) for p, s in self.owned.items()},
        }
        return {
            "topic": topic,
            "watermark_ms": self.watermark_ms,
            "watermark_lag_ms": self.lag_ms(now_ms),
            "max_out_of_orderness_ms": self.max_out_of_orderness_ms,
            "allowed_lateness_ms": self.allowed_lateness_ms,
            "partitions": {
                str(p): {
                    "owner": owner,
                    "max_event_time_ms": s.max_event_time_ms,
                    "watermark_ms": self.partition_watermark(s),
                    "idle": self.is_idle(s, now_ms),
                }
                for p, (owner, s) in sorted(partitions.items())
            },
        }

    # --- transactions: a batch that is aborted leaves no trace ----------------------------------
    def snapshot(self) -> WatermarkSnapshot:
        return WatermarkSnapshot(
            {p: copy.copy(s) for p, s in self.owned.items()}, self.watermark_ms, self.advanced
        )

    def rollback(self, snapshot: WatermarkSnapshot) -> None:
        self.owned = {p: copy.copy(s) for p, s in snapshot.owned.items()}
        self.watermark_ms = snapshot.watermark_ms
        self.advanced = snapshot.advanced

    def _raise_to(self, candidate: int) -> None:
        if self.watermark_ms is None or candidate > self.watermark_ms:
            self.watermark_ms = candidate
