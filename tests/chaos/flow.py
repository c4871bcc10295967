"""Whether work flows through the platform: ingest's committed offsets and the results in Redis.

A fault injector measures its recovery with it: the seconds from a kill until every raw topic was
ingested further and every job that emits on update counted more in Redis than at the kill.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from confluent_kafka import Consumer, KafkaException, TopicPartition

from shared.kafka import client_config
from tests.bench.workload import RedisWindows

INGEST_GROUP = "sf-ingest"


class Flow:
    def __init__(
        self, bootstrap: str, client: redis.Redis, specs: dict[str, dict[str, Any]], timeout_s: float
    ) -> None:
        # The ingest group's committed offsets, read by a consumer of that group that never joins it:
        # AdminClient.list_consumer_group_offsets segfaults when the killed broker was the group's
        # coordinator (its NOT_COORDINATOR handling needs a consumer group: librdkafka issue #5040).
        self.offsets = Consumer(
            {
                **client_config(bootstrap),
                "group.id": INGEST_GROUP,
                "enable.auto.commit": False,
                "socket.timeout.ms": 5000,
            }
        )
        self.redis = client
        self.counted = [RedisWindows(self.redis, j) for j, s in specs.items() if s.get("emit") is None]
        self.raw_topics = sorted(specs)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.offsets.close()

    def progress(self) -> list[int]:
        """The ingest group's committed offset of each raw topic, then each on-update job's count.
        (Not the .valid topics' end offsets read with a consumer: that one keeps asking a killed
        broker.)"""
        try:
            committed = self.offsets.committed([TopicPartition(t, 0) for t in self.raw_topics], timeout=10)
            offsets = [tp.offset for tp in committed]
        except KafkaException:
            offsets = [-1] * len(self.raw_topics)
        try:
            counts = [w.count_sum("n")[0] for w in self.counted]
        except redis.RedisError:
            counts = [-1] * len(self.counted)
        return offsets + counts

    def wait_started(self) -> float:
        """Seconds until every raw topic was ingested and every on-update job counted in Redis."""
        began = time.monotonic()
        while not all(p > 0 for p in self.progress()):
            if time.monotonic() - began > self.timeout_s:
                raise AssertionError(f"nothing flowed within {self.timeout_s:g} s: {self.progress()}")
            time.sleep(0.5)
        return round(time.monotonic() - began, 1)

    def wait_flowing(self, killed_at: float, before: list[int] | None = None) -> dict[str, Any]:
        """Seconds from the kill until every raw topic was ingested further (``ingested_s``) and
        each on-update job counted more in Redis (``counted_s``, per job) than at the kill
        (``before``: the progress then, if read earlier)."""
        before = before if before is not None else self.progress()
        raw = len(self.raw_topics)
        names = [f"ingested {t}" for t in self.raw_topics] + [w.job_id for w in self.counted]
        seen: dict[str, float] = {}
        deadline = time.monotonic() + self.timeout_s
        now = before
        while time.monotonic() < deadline and len(seen) < len(names):
            now = self.progress()
            for name, a, b in zip(names, now, before, strict=True):
                if name not in seen and a > b:
                    seen[name] = round(time.monotonic() - killed_at, 1)
            time.sleep(0.25)
        if len(seen) < len(names):
            stuck = [n for n in names if n not in seen]
            raise AssertionError(f"no progress within {self.timeout_s:g} s for {stuck}: {before} -> {now}")
        return {
            "ingested_s": max(seen[n] for n in names[:raw]),
            "counted_s": {n.split("-")[1]: seen[n] for n in names[raw:]},
        }
