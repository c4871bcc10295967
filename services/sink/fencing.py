"""The fences the sink has read, per partition, kept in Redis so a restart or a new owner knows them.

See shared/fences.py for what a fence is. A partition's fences are loaded before the first record read
after an assignment (another replica may have read new ones meanwhile), and a new fence is stored
before any record after it is taken: a crash after storing it replays the fence itself, which adds
nothing.
"""

from __future__ import annotations

import redis

from services.sink.cache import TopicPartitionKey
from shared.fences import FENCES_KEY, Fence, PartitionFences, partition_field


class SinkFences:
    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._fences: dict[TopicPartitionKey, PartitionFences] = {}
        self._loaded = False

    def forget(self) -> None:
        """Read them again from Redis before the next record (the assignment changed)."""
        self._loaded = False

    def ensure_loaded(self) -> None:
        """Raises redis.RedisError (nothing loaded) or ValueError for a value this code did not write."""
        if self._loaded:
            return
        raw = self._client.hgetall(FENCES_KEY)
        fences = {}
        for name, value in raw.items():
            topic, _, partition = (name.decode() if isinstance(name, bytes) else name).rpartition(":")
            fences[(topic, int(partition))] = PartitionFences.from_json(value)
        self._fences = fences
        self._loaded = True

    def add(self, source: TopicPartitionKey, offset: int, fence: Fence) -> bool:
        """Take a fence read at ``offset`` of ``source``, stored in Redis first; False if not new.

        Raises redis.RedisError with nothing changed."""
        current = self._fences.get(source, PartitionFences())
        grown = PartitionFences({job: list(f) for job, f in current.by_job.items()})
        if not grown.add(fence, offset):
            return False
        self._client.hset(FENCES_KEY, partition_field(*source), grown.to_json())
        self._fences[source] = grown
        return True

    def stale_by(
        self, source: TopicPartitionKey, job_id: str, epoch: int, offset: int
    ) -> tuple[int, int] | None:
        fences = self._fences.get(source)
        return fences.stale_by(job_id, epoch, offset) if fences is not None else None
