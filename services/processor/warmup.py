"""Warm-up: a processor that starts with no job runs a throwaway job of its own before it registers.

A standby processor is there to take over the jobs of one that dies. Its JVM is up, but the first
micro-batch of the first query it runs still pays for everything a cold JVM does once: loading and
JIT-compiling the Kafka source and sink, JSON parsing, the window aggregation's generated code, the
RocksDB state store and checkpointing. Measured on this 2-core machine
(``python -m tests.bench recovery``): a taken-over job's first batch took 14.4 s on an idle standby and
3.9 s on one that had run a job before.

So with ``SF_PROCESSOR_WARMUP_S`` > 0, a processor that resumed no job and was given no spec file
produces synthetic events to a topic of its own (``_sf-warmup-<id>.valid``, the format ingest writes)
and runs a windowed job over them (every kind of aggregate) through the same code path as every job,
within that many seconds (its backlog's write included); then it stops the query and deletes the
topics and the checkpoint. It registers with control only after that, so control never places a job
on a processor still warming. A failure is logged and ignored: a cold standby is still a standby. The
topics' names carry the second the warm-up began, so that a later warm-up deletes those that a
processor killed while warming left behind (``delete_stale_topics``).

The events come in two parts. First a backlog (``SF_PROCESSOR_WARMUP_BACKLOG_EVENTS``, written at
once before the query starts, event times over the minute before now), which the job drains in full
micro-batches as it would a burst: that is what makes the JIT compile the per-row code (the Kafka
read, JSON parsing, the aggregation's hash map, the state store). A quiet job's small batches do not:
a fresh JVM drained the bench's 1M-event burst at 42-49k events/s; after a 300,000-event backlog of
this job, another query shape, at 69-73k (tests/bench/README.md, "A processor warmed on a backlog").
Then 1,000 events/s for the rest of the time, whose small batches compile each batch's fixed work
(planning, commits) the way a quiet job's first minutes would.

Before that job it maps the case of a few strings, for a job it takes over that calls ``lower``,
``upper`` or ``initcap`` (the warm-up job calls none): see ``warm_case_mapping``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from confluent_kafka import KafkaException, Producer
from pyspark.sql import SparkSession

from services.processor.query import STOPPED_TASKS_TIMEOUT_S, await_tasks, start_query
from services.processor.settings import ProcessorSettings
from shared import constants
from shared.constants import join_key
from shared.jobspec import FieldType, JobSpec, Source
from shared.kafka import admin, ensure_topics
from shared.packs import pack, packed_event

log = logging.getLogger(__name__)

WARMUP_EVENTS_PER_S = 1_000
WARMUP_KEYS = 100
BACKLOG_KEYS = 1_000
BACKLOG_PACK_EVENTS = 200  # a backlog record packs this many events, as ingest packs a batch's
BACKLOG_SPAN_MS = 60_000  # the backlog's event times: in order, over the minute before the live events'
TOPIC_PREFIX = "_sf-warmup-"
# A warm-up ends within its time (600 s at most, settings.py) and its clean-up: topics whose warm-up
# began longer ago than this were left by a processor killed while warming.
STALE_AFTER_S = 3_600
_TAGGED = re.compile(rf"^{re.escape(TOPIC_PREFIX)}(\d{{10,}})-[0-9a-f]+(\.out|\.valid)?$")


def new_tag(now: float | None = None) -> str:
    """A warm-up's tag: the second it began, then random hex (``1764350000-3fa9c2``)."""
    return f"{int(time.time() if now is None else now)}-{uuid.uuid4().hex[:6]}"


def stale_topics(names: Iterable[str], now: float) -> list[str]:
    """The warm-up topics among ``names`` whose tag says they began over ``STALE_AFTER_S`` ago. Names
    without a time in their tag (another naming, or not a warm-up's) are never stale."""
    stale = []
    for name in names:
        tagged = _TAGGED.match(name)
        if tagged is not None and now - int(tagged.group(1)) > STALE_AFTER_S:
            stale.append(name)
    return sorted(stale)


def delete_stale_topics(bootstrap: str, now: float, timeout_s: float = 10.0) -> list[str]:
    """Delete the warm-up topics left by warm-ups that began over ``STALE_AFTER_S`` ago (their processor
    was killed before its clean-up); returns their names. Failures are logged, not raised."""
    try:
        stale = stale_topics(admin(bootstrap).list_topics(timeout=timeout_s).topics, now)
    except KafkaException as e:
        log.warning("warm-up topics not listed: %s", e)
        return []
    if stale:
        log.info("deleting %d warm-up topic(s) left by killed warm-ups: %s", len(stale), ", ".join(stale))
        _delete_topics(bootstrap, stale, timeout_s)
    return stale


def warmup_spec(tag: str) -> JobSpec:
    """A tumbling-window job with the common aggregations over the warm-up topic."""
    return JobSpec.model_validate(
        {
            "id": f"{constants.WARMUP_JOB_PREFIX}{tag}",
            "source": {
                "topic": f"{TOPIC_PREFIX}{tag}",
                "fields": {"page": "string", "latency": "double", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "1s"},
            "watermark": {"max_out_of_orderness": "1s"},
            "aggregations": [
                {"fn": "count", "as": "n"},
                {"fn": "sum", "field": "latency", "as": "total"},
                {"fn": "avg", "field": "latency", "as": "mean"},
                {"fn": "min", "field": "latency", "as": "low"},
                {"fn": "max", "field": "latency", "as": "high"},
                {"fn": "stddev", "field": "latency", "as": "sd"},
                {"fn": "stddev_pop", "field": "latency", "as": "sdp"},
                {"fn": "percentiles", "field": "latency", "percentiles": [50, 99], "as": "p"},
            ],
            "trigger_interval": "500ms",
            "output_topic": f"{TOPIC_PREFIX}{tag}.out",
        }
    )


# Spark 4 maps case through ICU (``spark.sql.icu.caseMappings.enabled``, on by default). The first
# call in a JVM initialises ``CollationAwareUTF8String``, whose static table title-cases every code
# point: ~2 s of a core on this machine, once per JVM, paid by the first batch that maps a non-NULL
# value (the bench README, "A standby's first batch: ICU's case tables"). Over a column, not literals,
# so that it runs in generated code as a job's would, not in the optimizer's constant folding.
CASE_MAPPINGS = (
    "lower(concat('İÄ', id)) AS l",
    "upper(concat('ßǆ', id)) AS u",
    "initcap(concat('ǆa b', id)) AS t",
)


def warm_case_mapping(spark: SparkSession, timeout_s: float | None = None) -> list[tuple[str, str, str]]:
    """Map the case of one row through ``lower``, ``upper`` and ``initcap``; returns what they gave.

    Its Spark job is cancelled after ``timeout_s``, when given (then it returns []): a new application
    on a loaded cluster can wait long for its first executor (30-50 s seen in the cluster fault test,
    where the warm-up of a restarted processor outlasted its bound by that much)."""
    sc = spark.sparkContext
    tag = f"sf-case-mapping-{uuid.uuid4().hex[:8]}"
    done, late = threading.Event(), threading.Event()

    def cancel_when_late() -> None:
        if done.wait(timeout_s):
            return
        late.set()
        # Again until it returns: a cancel only reaches jobs already submitted, and a cold JVM can
        # still be planning this one.
        while not done.is_set():
            sc.cancelJobsWithTag(tag)
            done.wait(0.5)

    sc.addJobTag(tag)  # this thread's jobs (PySpark pins a Python thread to a JVM thread)
    try:
        if timeout_s is not None:
            threading.Thread(target=cancel_when_late, name="case-mapping-timeout", daemon=True).start()
        return [(r.l, r.u, r.t) for r in spark.range(1).selectExpr(*CASE_MAPPINGS).collect()]
    except Exception as e:  # a job that calls them maps its first case itself
        if late.is_set():
            log.warning("case mapping not warmed: cancelled after %.0f s (no executor yet?)", timeout_s)
        else:
            log.warning("case mapping not warmed (%s): %s", type(e).__name__, str(e).splitlines()[0][:200])
        return []
    finally:
        done.set()
        sc.removeJobTag(tag)


class Synthetic:
    """Events for a source as ingest forwards them to ``<topic>.valid``: its declared fields in
    order, timestamps in epoch ms, keyed by its key fields (shared.constants.join_key). The ``i``-th
    event's key is one of ``keys``; its other values cycle over a few hundred."""

    def __init__(self, source: Source, keys: int) -> None:
        self.source = source
        self.keys = keys
        # Per field, once: its name, type and whether it is a key field (each event only looks these up).
        self._fields = [(name, kind, name in source.key) for name, kind in source.fields.items()]

    def _value(
        self, name: str, kind: FieldType, is_key: bool, i: int, ts_ms: int
    ) -> str | int | float | bool:
        if kind == FieldType.TIMESTAMP:
            return ts_ms
        n = i % self.keys if is_key else i % 997
        if kind == FieldType.STRING:
            return f"{name[0]}{n}"
        if kind == FieldType.LONG:
            return n
        if kind == FieldType.DOUBLE:
            return n / 8
        return n % 2 == 0  # BOOLEAN

    def record(self, i: int, ts_ms: int) -> tuple[bytes, bytes]:
        """The ``i``-th event's record key and value."""
        values = {name: self._value(name, kind, is_key, i, ts_ms) for name, kind, is_key in self._fields}
        # Each key part as ingest renders it (services/ingest/validate.py: str() of the value).
        key = join_key([str(values[k]) for k in self.source.key])
        return key.encode(), orjson.dumps(values)

    def element(self, i: int, ts_ms: int) -> bytes:
        """The ``i``-th event as an element of a pack (shared/packs.py)."""
        key, value = self.record(i, ts_ms)
        return packed_event(key.decode(), value)


def _produce(bootstrap: str, topic: str, events: Synthetic, stop: threading.Event) -> int:
    """Events at WARMUP_EVENTS_PER_S, their event times now, until ``stop``."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    sent = 0
    started = time.monotonic()
    while not stop.wait(0.05):
        due = int((time.monotonic() - started) * WARMUP_EVENTS_PER_S) - sent
        now_ms = int(time.time() * 1000)
        for i in range(sent, sent + due):
            key, value = events.record(i, now_ms)
            producer.produce(topic, key=key, value=value)
        sent += max(due, 0)
        producer.poll(0)
    producer.flush(10)
    return sent


class Warmed(NamedTuple):
    batches: int  # the throwaway job's micro-batches (0: the warm-up failed)
    records: int  # the records they read, the backlog's included (BACKLOG_PACK_EVENTS events each)
    largest_batch: int = 0  # the most records one of its last 100 batches read (recentProgress)


def fill_backlog(
    bootstrap: str,
    topic: str,
    events: int,
    now_ms: int,
    deadline: float,
    synthetic: Synthetic | None = None,
    cancel: threading.Event | None = None,
) -> int:
    """Up to ``events`` events (default: the warm-up job's), their event times in order over the
    minute before ``now_ms``, packed BACKLOG_PACK_EVENTS to a record as ingest packs them, produced at
    once (~1 s for 300,000 on a quiet machine), until the monotonic ``deadline`` or ``cancel``: on a
    loaded machine the rest is left out, so that the warm-up keeps to its time. Returns how many
    events were sent by then (acknowledged by the broker)."""
    synthetic = synthetic or Synthetic(warmup_spec("x").source, BACKLOG_KEYS)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1_000_000})
    start = now_ms - BACKLOG_SPAN_MS
    sizes: list[int] = []  # events per record produced
    produced = 0
    value: bytes | None = None  # the next record, kept while librdkafka's queue is full
    while produced < events and time.monotonic() < deadline and not (cancel is not None and cancel.is_set()):
        n = min(BACKLOG_PACK_EVENTS, events - produced)
        if value is None:
            times = [start + i * BACKLOG_SPAN_MS // events for i in range(produced, produced + n)]
            value = pack([synthetic.element(produced + j, t) for j, t in enumerate(times)])
        try:
            producer.produce(topic, value=value)
        except BufferError:  # librdkafka's queue is full: let it send
            producer.poll(0.05)
            continue
        value = None
        sizes.append(n)
        produced += n
    left = producer.flush(max(0.0, deadline - time.monotonic()))
    if left:  # not sent by the deadline: dropped (those already in flight may still land)
        producer.purge()
        producer.flush(1)
    sent = produced - sum(sizes[len(sizes) - left :]) if left else produced
    if sent < events:
        log.info("warm-up backlog cut at its deadline: %d of %d events", sent, events)
    return sent


def records_read(progress: dict[str, Any] | None) -> int:
    """How many records a query of the warm-up's topic (new, so its offsets start at 0) has read: its
    Kafka source's end offsets in the last progress report. Not a sum over ``recentProgress``, which
    keeps the last 100 reports only (``spark.sql.streaming.numRecentProgressUpdates``)."""
    return _offsets(progress, "endOffset")


def batch_records(progress: dict[str, Any] | None) -> int:
    """How many Kafka records the batch of one progress report read (its end offsets less its start)."""
    return _offsets(progress, "endOffset") - _offsets(progress, "startOffset")


def _offsets(progress: dict[str, Any] | None, which: str) -> int:
    """The sum of a progress report's ``which`` offsets over its sources' partitions (none: 0)."""
    if not progress:
        return 0
    total = 0
    for source in progress.get("sources", []):
        offsets = source.get(which)
        if isinstance(offsets, str):
            offsets = json.loads(offsets)  # "null" before a source's first batch
        if offsets:
            total += sum(int(offset) for partitions in offsets.values() for offset in partitions.values())
    return total


def shaped_like(spec: JobSpec, tag: str) -> JobSpec | None:
    """The job ``spec`` on warm-up topics of its own under a warm-up id: the same plan, so the same
    generated code (Spark caches a compiled class by its source text). None for a join, whose two
    streams the warm-up does not make."""
    if spec.join is not None:
        return None
    topic = f"{TOPIC_PREFIX}{tag}"
    return spec.model_copy(
        update={
            "id": f"{constants.WARMUP_JOB_PREFIX}{tag}",
            "name": None,
            "source": spec.source.model_copy(update={"topic": topic}),
            "output_topic": f"{topic}.out",
        }
    )


def shape_of(spec: JobSpec) -> str:
    """What a job's plan depends on: its spec but for its id, name and topics."""
    shaped = shaped_like(spec, "x")
    return shaped.model_dump_json(by_alias=True) if shaped is not None else ""


def warm_up(
    spark: SparkSession,
    settings: ProcessorSettings,
    tag: str = "",
    seconds: float = 0,
    workdir: Path | None = None,
    *,
    like: JobSpec | None = None,
    backlog: int | None = None,
    cancel: threading.Event | None = None,
    starting: contextlib.AbstractContextManager[Any] | None = None,
) -> Warmed:
    """Run the throwaway job over a backlog of ``backlog`` events (default
    ``settings.warmup_backlog_events``) and then 1,000 events/s, all within ``seconds`` (default
    ``settings.warmup_s``) but for the clean-up, or until ``cancel`` is set; returns what it ran (no
    batches when it failed: logged, never raised). The job is ``warmup_spec``'s, or ``like`` on
    warm-up topics (``shaped_like``). Its query starts inside ``starting`` (the processor's command
    lock, when jobs may start meanwhile). Its checkpoint goes in ``workdir`` (default: the data
    directory): the processor gives its scratch directory, which the next start removes should this
    one be killed during the warm-up."""
    seconds = seconds or settings.warmup_s
    backlog_events = settings.warmup_backlog_events if backlog is None else backlog
    tag = tag or new_tag()
    spec = shaped_like(like, tag) if like is not None else warmup_spec(tag)
    if spec is None:
        log.info("no warm-up on the shape of job %s: a join", like.id if like else "")
        return Warmed(0, 0)
    cancelled = cancel or threading.Event()
    bootstrap = settings.kafka_bootstrap
    topics = [spec.source.valid_topic, spec.output_topic]
    checkpoint: Path | None = None
    stop = threading.Event()
    producer = threading.Thread(
        target=_produce,
        args=(bootstrap, spec.source.valid_topic, Synthetic(spec.source, WARMUP_KEYS), stop),
        name="warmup-producer",
        daemon=True,
    )
    began = time.monotonic()
    batches = rows = largest = 0
    created = False
    # The set-up (topics, then the backlog's write) gets at most half the time, the query the rest: on a
    # loaded machine the backlog's write alone outlasted a 30 s warm-up (300,000 events, 28 s), and its
    # processor registered late.
    set_up_by = began + seconds / 2
    try:
        if cancelled.is_set():
            raise WarmUpCancelled
        warm_case_mapping(spark, timeout_s=max(1.0, set_up_by - time.monotonic()))
        parent = workdir or Path(settings.data_dir)
        parent.mkdir(parents=True, exist_ok=True)
        checkpoint = Path(tempfile.mkdtemp(prefix="sf-warmup-", dir=parent))
        delete_stale_topics(bootstrap, time.time(), timeout_s=_set_up_timeout(set_up_by))
        ensure_topics(bootstrap, topics, partitions=1, timeout_s=_set_up_timeout(set_up_by))
        created = True
        sent = fill_backlog(
            bootstrap,
            spec.source.valid_topic,
            backlog_events,
            int(time.time() * 1000),
            deadline=set_up_by,
            synthetic=Synthetic(spec.source, BACKLOG_KEYS),
            cancel=cancelled,
        )
        if cancelled.is_set():
            raise WarmUpCancelled
        producer.start()
        with starting or contextlib.nullcontext():
            query = start_query(
                spark,
                spec,
                bootstrap,
                str(checkpoint),
                min(settings.max_offsets_per_trigger, settings.warmup_batch_records),
                epoch=0,
                task_records=settings.max_records_per_read_task,
            )
        try:
            end = began + seconds
            while (left := end - time.monotonic()) > 0 and not cancelled.wait(min(left, 0.25)):
                if not query.isActive:
                    break
            failure = query.exception()
            if failure is not None:
                raise failure
            progress = query.lastProgress
            batches = int(progress["batchId"]) + 1 if progress else 0
            rows = records_read(progress)
            largest = max((batch_records(p) for p in query.recentProgress), default=0)
        finally:
            query.stop()
            # Before its checkpoint is removed (below): a killed task may still write there.
            if not await_tasks(spark, str(query.runId), STOPPED_TASKS_TIMEOUT_S):
                log.warning("a warm-up task still ran %.0f s after it stopped", STOPPED_TASKS_TIMEOUT_S)
        log.info(
            "warmed up%s in %.1f s: %d batches of a throwaway job%s, %d records read, at most %d a batch "
            "(a backlog of %d events first)",
            " (cancelled: a job starts here)" if cancelled.is_set() else "",
            time.monotonic() - began,
            batches,
            f" shaped like job {like.id}" if like is not None else "",
            rows,
            largest,
            sent,
        )
    except WarmUpCancelled:
        log.info("warm-up cancelled after %.1f s: a job starts here", time.monotonic() - began)
    except Exception as e:  # a cold standby still works: say so and go on
        log.warning(
            "warm-up failed after %.1f s (%s: %s); starting cold",
            time.monotonic() - began,
            type(e).__name__,
            e,
        )
    finally:
        stop.set()
        if producer.is_alive():
            producer.join(timeout=15)
        if checkpoint is not None:
            shutil.rmtree(checkpoint, ignore_errors=True)
        if created:
            _delete_topics(bootstrap, topics)
        _collect_garbage(spark)
    return Warmed(batches, rows, largest)


def _set_up_timeout(set_up_by: float) -> float:
    """An admin call's timeout within the set-up's time: 1-10 s."""
    return min(10.0, max(1.0, set_up_by - time.monotonic()))


class WarmUpCancelled(Exception):
    """A job starts on this processor: the warm-up gives way."""


def _collect_garbage(spark: SparkSession) -> None:
    """A full collection once the throwaway job is gone: draining the backlog grew G1's heap towards
    its limit, and a full collection gives the free part back to the OS (MaxHeapFreeRatio), where an
    idle processor's young collections would not for a long time."""
    try:
        jvm = spark.sparkContext._jvm
        if jvm is not None:
            jvm.java.lang.System.gc()
    except Exception as e:  # the memory stays with the JVM; nothing else depends on it
        log.warning("no full collection after the warm-up (%s: %s)", type(e).__name__, e)


def _delete_topics(bootstrap: str, topics: list[str], timeout_s: float = 10.0) -> None:
    try:
        client = admin(bootstrap)  # held until the futures are done: its handle answers them
        for future in client.delete_topics(topics, operation_timeout=timeout_s).values():
            future.result(timeout=timeout_s + 5)
    except (KafkaException, TimeoutError) as e:
        log.warning("warm-up topics %s not deleted: %s", topics, e)
