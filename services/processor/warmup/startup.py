"""The warm-up: a throwaway job an idle processor runs before it registers, so that a job it takes
over starts on a warm JVM.

The first batch of a cold JVM's first query loads and JIT-compiles everything (Kafka source and sink,
JSON parsing, the aggregation's generated code, RocksDB state). So the warm-up writes a backlog of
synthetic events to topics of its own and drains it in full micro-batches, as a job catching up
would (that compiles the per-row code), then reads live events for the rest of its time (that
compiles each batch's fixed work). Then it stops and deletes its topics and checkpoint. A failure is
logged and ignored: a cold standby is still a standby.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from pyspark.sql import SparkSession

from services.processor.jobs.query import start_query
from services.processor.settings import ProcessorSettings
from services.processor.spark.scheduler import STOPPED_TASKS_TIMEOUT_S, await_tasks
from services.processor.warmup.specs import shaped_like, warmup_spec
from services.processor.warmup.synthetic import (
    BACKLOG_KEYS,
    LIVE_KEYS,
    Synthetic,
    fill_backlog,
    produce_live,
)
from services.processor.warmup.topics import delete_stale_topics, delete_topics, new_tag
from shared.jobspec import JobSpec
from shared.kafka import ensure_topics

log = logging.getLogger(__name__)

# Spark 4 maps case through ICU: the first call in a JVM builds a table over every code point, a
# cost paid by the first batch that maps case. Over a column, not literals, so that it runs in
# generated code as a job's would, not in the optimizer's constant folding.
CASE_MAPPINGS = (
    "lower(concat('İÄ', id)) AS l",
    "upper(concat('ßǆ', id)) AS u",
    "initcap(concat('ǆa b', id)) AS t",
)


def warm_case_mapping(spark: SparkSession, timeout_s: float | None = None) -> list[tuple[str, str, str]]:
    """Map the case of one row through ``lower``, ``upper`` and ``initcap``; returns what they gave.

    Its Spark job is cancelled after ``timeout_s``, when given (then it returns []): a new application
    on a loaded cluster can wait long for its first executor."""
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


class Warmed(NamedTuple):
    batches: int  # the throwaway job's micro-batches (0: the warm-up failed)
    records: int  # the records they read, the backlog's included (BACKLOG_PACK_EVENTS events each)
    largest_batch: int = 0  # the most records one of its last 100 batches read (recentProgress)


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
    ``settings.tuning.warmup_backlog_events``) and then live events (LIVE_EVENTS_PER_S), all within
    ``seconds`` (default ``settings.warmup_s``) but for the clean-up, or until ``cancel`` is set;
    returns what it ran (no batches when it failed: logged, never raised). The job is
    ``warmup_spec``'s, or ``like`` on warm-up topics (``shaped_like``). Its query starts inside
    ``starting`` (the processor's command lock, when jobs may start meanwhile). Its checkpoint goes in
    ``workdir`` (default: the data directory): the processor gives its scratch directory, which the
    next start removes should this one be killed during the warm-up."""
    seconds = seconds or settings.warmup_s
    backlog_events = settings.tuning.warmup_backlog_events if backlog is None else backlog
    tag = tag or new_tag()
    spec = shaped_like(like, tag) if like is not None else warmup_spec(tag)
    if spec is None:
        log.info("no warm-up on the shape of job %s: a join", like.id if like else "")
        return Warmed(0, 0)
    cancelled = cancel or threading.Event()
    kafka = settings.kafka
    topics = [spec.source.valid_topic, spec.output_topic]
    checkpoint: Path | None = None
    stop = threading.Event()
    producer = threading.Thread(
        target=produce_live,
        args=(kafka, spec.source.valid_topic, Synthetic(spec.source, LIVE_KEYS), stop),
        name="warmup-producer",
        daemon=True,
    )
    began = time.monotonic()
    batches = rows = largest = 0
    created = False
    # The set-up (topics, then the backlog's write) gets at most half the time, the query the rest: on a
    # loaded machine the backlog's write alone can outlast the warm-up, and the processor registers late.
    set_up_by = began + seconds / 2
    try:
        if cancelled.is_set():
            raise WarmUpCancelled
        warm_case_mapping(spark, timeout_s=max(1.0, set_up_by - time.monotonic()))
        parent = workdir or Path(settings.data_dir)
        parent.mkdir(parents=True, exist_ok=True)
        checkpoint = Path(tempfile.mkdtemp(prefix="sf-warmup-", dir=parent))
        delete_stale_topics(kafka, time.time(), timeout_s=_set_up_timeout(set_up_by))
        ensure_topics(kafka, topics, partitions=1, timeout_s=_set_up_timeout(set_up_by))
        created = True
        sent = fill_backlog(
            kafka,
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
                kafka,
                str(checkpoint),
                min(settings.tuning.max_offsets_per_trigger, settings.tuning.warmup_batch_records),
                epoch=0,
                task_records=settings.tuning.max_records_per_read_task,
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
            delete_topics(kafka, topics)
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
