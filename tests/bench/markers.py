"""Live load with marker events, and the moment each marker's window appears in Redis.

``Load`` sends background events on 1,000 keys at a steady rate plus marker events (default 20/s),
each marker on a key of its own, all with event time = send time, and keeps the oracle as it goes
(events per window). ``MarkerWatch`` subscribes to Redis keyspace notifications for the markers'
window hashes: the sink's upsert is a Redis Function whose HSET emits an ``hset`` keyspace event
(``notify-keyspace-events Kh``), published the moment the write is applied. A marker's freshness
is the receive time of the first notification for its window minus the time it was sent, both
read from this process's wall clock.

``first_timestamps`` splits that time into stages after the fact: the CreateTime of each marker's
first record in ``<topic>.valid`` (set when ingest produced it) and in the job's output topic (set
when the processor's Kafka sink sent the window's update), read back once the load is over so the
measurement itself adds no consumer to the machine.
"""

from __future__ import annotations

import bisect
import math
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from shared import constants
from shared.kafka import client_config
from shared.packs import events_of
from tests.bench import workload

MARKER_PREFIX = "m"  # background keys start with "k": a pattern on "m*" sees only markers


@dataclass
class Marker:
    key: str
    sent: float  # time.time() just before produce()


class Load:
    """Background events and markers into one raw topic; the oracle of what was sent."""

    def __init__(self, bootstrap: str, topic: str, keys: int = workload.KEYS) -> None:
        self.topic = topic
        # Background events are batched as a client's default linger.ms batches them; markers must not
        # wait for a batch, so they get their own producer that sends at once (one producer for both
        # would send a request every few ms and load the broker on the cores the stack under test uses).
        self.producer = Producer({**client_config(bootstrap)})
        self.marker_producer = Producer({**client_config(bootstrap), "linger.ms": 1})
        self.keys = [f"k{i:04d}" for i in range(keys)]
        self.counts: Counter[workload.Window] = Counter()
        self.markers: list[Marker] = []
        self.sent = 0

    def run(
        self,
        rate: float,
        seconds: float,
        marker_rate: float = 20,
        until: Callable[[], bool] | None = None,
    ) -> list[Marker]:
        """Send for ``seconds`` (or until ``until()`` says so); returns the markers sent meanwhile."""
        producer, marker_producer, keys, counts = self.producer, self.marker_producer, self.keys, self.counts
        first_marker = len(self.markers)
        started = time.monotonic()
        background = markers = 0
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= seconds or (until is not None and until()):
                break
            ts = int(time.time() * 1000)
            window = ts - ts % workload.WINDOW_MS
            for _ in range(int(elapsed * rate) - background):
                k = keys[self.sent % len(keys)]
                value = orjson.dumps({"k": k, "user": "u1", "value": 1.0, "ts": ts})
                self._produce(producer, value)
                counts[(k, window)] += 1
                self.sent += 1
                background += 1
            for _ in range(int(elapsed * marker_rate) - markers):
                key = f"{MARKER_PREFIX}{len(self.markers):07d}"
                sent = time.time()
                ts_marker = int(sent * 1000)
                value = orjson.dumps({"k": key, "user": "u1", "value": 1.0, "ts": ts_marker})
                self._produce(marker_producer, value)
                self.markers.append(Marker(key, sent))
                counts[(key, ts_marker - ts_marker % workload.WINDOW_MS)] += 1
                self.sent += 1
                markers += 1
            producer.poll(0)
            marker_producer.poll(0)
            time.sleep(0.002)
        return self.markers[first_marker:]

    def _produce(self, producer: Producer, value: bytes) -> None:
        while True:
            try:
                producer.produce(self.topic, value)
                return
            except BufferError:
                producer.poll(0.01)

    def flush(self) -> None:
        if self.producer.flush(60) != 0 or self.marker_producer.flush(60) != 0:
            raise RuntimeError(f"not every event reached {self.topic}")

    def wait_exact(self, client: redis.Redis, job_id: str, timeout_s: float = 180) -> workload.Outcome:
        """Flush, then wait until Redis holds exactly the counts of everything sent (markers too)."""
        self.flush()
        return workload.wait_for_oracle(
            workload.RedisWindows(client, job_id),
            self.sent,
            lambda got: workload.count_problems(got, self.counts),
            [workload.COUNT_FIELD],
            t0=0.0,
            timeout_s=timeout_s,
        )


class MarkerWatch:
    """The first time each marker's window hash was written, from Redis keyspace notifications."""

    def __init__(self, redis_url: str, job_id: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.client.config_set("notify-keyspace-events", "Kh")
        prefix = constants.redis_window_key(job_id, "", 0).removesuffix(":0")
        self._strip = len(f"__keyspace@{db}__:{prefix}")
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(f"__keyspace@{db}__:{prefix}{MARKER_PREFIX}*")
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="marker-watch", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            msg = self.pubsub.get_message(timeout=0.2)
            if msg is None:
                continue
            received = time.time()
            channel = msg["channel"].decode()
            key = channel[self._strip :].rsplit(":", 1)[0]
            self.seen.setdefault(key, received)

    def freshness(self, marker: Marker) -> float | None:
        """Seconds from sending the marker to its window's first write (None: not seen yet)."""
        seen = self.seen.get(marker.key)
        return None if seen is None else seen - marker.sent

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pubsub.close()
        self.client.config_set("notify-keyspace-events", "")
        self.client.close()

    def __enter__(self) -> MarkerWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_timestamps(
    bootstrap: str, topic: str, since_ms: int, key_of: Callable[[bytes], str | None]
) -> dict[str, float]:
    """Per marker key: the CreateTime (s) of its first record in ``topic`` produced since ``since_ms``.

    ``key_of`` maps a record's key to the marker key it is about (None: not a marker's record).
    Reads every partition from ``since_ms`` to the end offsets it had when called.
    """
    return {key: at for key, (_, _, at) in first_records(bootstrap, topic, since_ms, key_of).items()}


def first_records(
    bootstrap: str, topic: str, since_ms: int, key_of: Callable[[bytes], str | None]
) -> dict[str, tuple[int, int, float]]:
    """Per marker key: (partition, offset, CreateTime in s) of its first record in ``topic``, as
    ``first_timestamps`` finds it."""
    consumer = Consumer(
        {
            **client_config(bootstrap),
            "group.id": f"bench-stages-{time.time_ns()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        parts = [TopicPartition(topic, p, since_ms) for p in metadata.partitions]
        starts = consumer.offsets_for_times(parts, timeout=10)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in metadata.partitions
        }
        todo = {tp.partition for tp in starts if 0 <= tp.offset < ends[tp.partition]}
        consumer.assign([tp for tp in starts if tp.partition in todo])
        first: dict[str, tuple[int, int, float]] = {}
        deadline = time.monotonic() + 120
        while todo and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=10_000, timeout=1.0):
                error = msg.error()
                if error is not None:  # the end (a transaction's last offset is its marker)
                    if error.code() == KafkaError._PARTITION_EOF:
                        todo.discard(msg.partition())
                    continue
                partition, offset = msg.partition(), msg.offset()
                if offset is not None and offset + 1 >= ends[partition]:
                    todo.discard(partition)
                for key in _keys(msg):
                    marker = key_of(key)
                    if marker is not None and marker not in first and offset is not None:
                        first[marker] = (partition, offset, msg.timestamp()[1] / 1000)
        return first
    finally:
        consumer.close()


# A record batch's header (Kafka's message format v2) up to its record count, and the two bits of its
# attributes that matter here.
_BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")
_TRANSACTIONAL, _CONTROL = 0x10, 0x20
_COMMIT = 1


def commit_times(topic_dir: Path) -> list[tuple[int, float]]:
    """(offset, time in s) of every transaction commit marker in a partition's log, in order.

    Read from the broker's segment files, which it only appends to: a consumer never sees control
    records, and the marker's timestamp is when the broker wrote it, i.e. when the transaction's
    records became visible to read_committed consumers.
    """
    out: list[tuple[int, float]] = []
    for segment in sorted(topic_dir.glob("*.log")):
        data = segment.read_bytes()
        at = 0
        while at + _BATCH_HEADER.size <= len(data):
            base, length, _, _, _, attributes, _, _, max_ts, _, _, _, _ = _BATCH_HEADER.unpack_from(data, at)
            end = at + 12 + length
            if length <= 0 or end > len(data):
                break  # the end of what the broker has written so far
            if attributes & _CONTROL and attributes & _TRANSACTIONAL:
                # The control record's key: version (int16) then type (int16; 0 abort, 1 commit),
                # after its length, attributes, timestamp delta, offset delta and key length varints.
                record = memoryview(data)[at + _BATCH_HEADER.size : end]
                pos = 0
                for _ in range(5):
                    while record[pos] & 0x80:
                        pos += 1
                    pos += 1
                if struct.unpack_from(">h", record, pos + 2)[0] == _COMMIT:
                    out.append((base, max_ts / 1000))
            at = end
    return out


def visible_at(
    records: dict[str, tuple[int, int, float]], commits: dict[int, list[tuple[int, float]]]
) -> dict[str, float]:
    """Per marker key: when the transaction that wrote its record committed (the first commit marker
    after the record on its partition)."""
    out: dict[str, float] = {}
    for key, (partition, offset, _) in records.items():
        markers = commits.get(partition, [])
        i = bisect.bisect_right(markers, (offset, math.inf))
        if i < len(markers):
            out[key] = markers[i][1]
    return out


def _keys(msg: Message) -> list[bytes]:
    """A record's key, or the keys of the events a `.valid` pack holds (shared/packs.py)."""
    value = msg.value() or b""
    if value.startswith(b"["):
        return [(k or "").encode() for k, _ in events_of(msg.key(), value)]
    return [msg.key() or b""]


def written_at(client: redis.Redis, job_id: str, markers: list[Marker]) -> dict[str, float]:
    """Per marker key: when the sink wrote its window, as the sink's own clock put it in the hash
    (``updated_at_ms``, taken as it builds the Redis call that carries the window). A marker's window
    holds that marker alone, so this is its first write unless the processor sent the window again."""
    pipe = client.pipeline(transaction=False)
    for m in markers:
        ts = int(m.sent * 1000)
        pipe.hget(constants.redis_window_key(job_id, m.key, ts - ts % workload.WINDOW_MS), "updated_at_ms")
    return {m.key: int(v) / 1000 for m, v in zip(markers, pipe.execute(), strict=True) if v is not None}


def stage_breakdown(
    markers: list[Marker],
    watch: MarkerWatch,
    valid: dict[str, float],
    output: dict[str, float],
    written: dict[str, float],
    committed: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Percentiles of each stage's share of the markers' freshness: ingest (sent -> produced to
    ``.valid``), processor (-> its window update produced to the output topic; includes ingest's
    transaction commit, before which the processor cannot read it) and sink (-> written to Redis);
    and of the sink's part, redis: from the sink's write call (``written_at``) to the notification,
    for the markers written once (a later write's time would come after the first notification);
    and of the processor's part, commit: until ingest's transaction holding the marker committed
    (``committed``, when known)."""
    stages: dict[str, list[float]] = {"ingest": [], "commit": [], "processor": [], "sink": [], "redis": []}
    for m in markers:
        seen = watch.seen.get(m.key)
        if seen is None or m.key not in valid or m.key not in output:
            continue
        stages["ingest"].append(valid[m.key] - m.sent)
        stages["processor"].append(output[m.key] - valid[m.key])
        stages["sink"].append(seen - output[m.key])
        if committed is not None and m.key in committed:
            stages["commit"].append(committed[m.key] - valid[m.key])
        if output[m.key] <= written.get(m.key, math.inf) <= seen:
            stages["redis"].append(seen - written[m.key])
    return {stage: percentiles_ms(values) for stage, values in stages.items()}


def timeline(
    markers: list[Marker],
    watch: MarkerWatch,
    valid: dict[str, float],
    committed: dict[str, float],
    output: dict[str, float],
    written: dict[str, float],
) -> list[list[float | None]]:
    """Per marker, in the order sent: its send time (epoch s) and, in ms from it, when it was in
    ``.valid``, when ingest's transaction holding it committed, when its window's update was in the
    output topic, written by the sink and seen in Redis (None: not known). Lines a slow marker up
    with what happened then (a real-time batch boundary, another job's batch)."""

    def after(m: Marker, at: float | None) -> float | None:
        return None if at is None else round((at - m.sent) * 1000, 1)

    stages = (valid, committed, output, written, watch.seen)
    return [[round(m.sent, 3), *(after(m, times.get(m.key)) for times in stages)] for m in markers]


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """p50/p95/p99/max (nearest rank) and mean of ``values`` (seconds), in milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)] * 1000, 1)

    return {
        "p50_ms": rank(50),
        "p95_ms": rank(95),
        "p99_ms": rank(99),
        "max_ms": round(ordered[-1] * 1000, 1),
        "mean_ms": round(sum(ordered) / len(ordered) * 1000, 1),
    }
