"""The ingest group's progress on every raw topic, read in the background.

Every replica commits, with each partition's offset, that partition's watermark progress (see
``watermark.PartitionProgress``). Reading the group's committed offsets therefore tells a replica the
watermark progress of the partitions the *other* replicas own, and, next to the topics' end offsets,
how far the group lags behind: the HTTP endpoint's backpressure signal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, TopicPartition

from services.ingest.watermark import PartitionProgress
from shared.kafka import KafkaAccess
from shared.metrics import CONSUMER_LAG

log = logging.getLogger(__name__)
SERVICE = "ingest"


@dataclass(frozen=True, slots=True)
class TopicProgress:
    lag_records: int  # records of the topic not yet committed by the group
    partitions: dict[int, PartitionProgress] = field(default_factory=dict)


class GroupProgress:
    """Polls committed offsets (with their metadata) and end offsets every ``interval_ms``."""

    def __init__(
        self, kafka: KafkaAccess, group_id: str, topics: Callable[[], list[str]], interval_ms: int
    ) -> None:
        self._topics = topics
        self._interval_s = interval_ms / 1000
        self._consumer = Consumer(
            {
                **kafka.config(),
                "group.id": group_id,  # only to read the group's offsets: it never subscribes or joins
                # read_uncommitted: return the last committed offsets at once instead of waiting for
                # the transactions the replicas have in flight (read_committed would block on them).
                "isolation.level": "read_uncommitted",
                "enable.auto.commit": False,
            },
            logger=logging.getLogger("librdkafka.progress"),
        )
        self._latest: dict[str, TopicProgress] = {}
        self._version = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ingest-progress", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            self._consumer.close()

    def latest(self) -> tuple[int, dict[str, TopicProgress]]:
        """(version, progress per topic); the version changes with every successful refresh."""
        return self._version, self._latest

    def lag(self, topic: str) -> int | None:
        progress = self._latest.get(topic)
        return None if progress is None else progress.lag_records

    def refresh(self) -> None:
        topics = self._topics()
        found: dict[str, TopicProgress] = {}
        with self._lock:
            for topic in topics:
                try:
                    found[topic] = self._read(topic)
                except KafkaException as e:
                    log.debug("cannot read the progress of %s: %s", topic, e)
        for topic, progress in found.items():
            CONSUMER_LAG.labels(SERVICE, topic).set(progress.lag_records)
        self._latest = found
        self._version += 1

    def _read(self, topic: str) -> TopicProgress:
        meta = self._consumer.list_topics(topic, timeout=5).topics.get(topic)
        if meta is None or meta.error is not None:
            raise KafkaException(meta.error if meta is not None else "no metadata")
        tps = [TopicPartition(topic, p) for p in sorted(meta.partitions)]
        committed = self._consumer.committed(tps, timeout=5)
        lag = 0
        partitions: dict[int, PartitionProgress] = {}
        for tp in committed:
            _, end = self._consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=5)
            start = tp.offset if tp.offset >= 0 else 0
            # A group that never committed on a partition lags by its whole content (auto.offset.reset
            # is earliest); retention may have removed some of it, which only overestimates.
            lag += max(0, end - start)
            progress = PartitionProgress.from_metadata(tp.metadata)
            if progress is not None:
                partitions[tp.partition] = progress
        return TopicProgress(lag_records=lag, partitions=partitions)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.refresh()
            except Exception:  # the view is advisory: a failed round is retried on the next tick
                log.exception("reading the group's progress failed")
