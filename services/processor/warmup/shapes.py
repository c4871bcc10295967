"""An idle processor warms up on the shape of each job control runs, so a job it takes over finds its
code compiled.

The start-up warm-up (warmup/startup.py) runs a throwaway job of its own shape: a job a standby takes
over would still generate, compile and interpret its own classes in its first batch. Spark caches a
compiled class by its source text (``spark.sql.codegen.cache.maxEntries``), and the same spec on other
topics gives the same text: so a warm-up on a copy of the job's spec (``specs.shaped_like``) leaves
that job's classes compiled, and the JIT has run them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from services.processor.settings import ProcessorSettings
from services.processor.warmup.specs import shape_of
from services.processor.warmup.startup import warm_up
from shared import constants
from shared.jobspec import JobSpec

log = logging.getLogger(__name__)

SHAPE_WARMUP_DELAY_S = 3.0
MAX_PENDING = 8  # shapes waiting; more are left for the next push (control sends the specs again on change)
MAX_WARMED = 256  # shapes remembered as warmed (Spark's codegen cache keeps 100 classes by default)
CANCEL_WAIT_S = 30.0  # how long a job's start waits for a warm-up's query to stop


class ShapeWarmer:
    """Control sends every processor the specs of the active jobs (StreamConfig.ApplyStreams, as it
    does ingest and the sink). A processor that runs no job warms up once on each shape it has not
    warmed yet, one at a time, ``shape_warmup_s`` each, ``SHAPE_WARMUP_DELAY_S`` after the specs came
    (so the processor a new job is placed on starts it first). A job starting here cancels a warm-up
    that runs and waits for its query to stop: a takeover never shares the JVM with a warm-up."""

    def __init__(
        self,
        spark: SparkSession,
        settings: ProcessorSettings,
        idle: Callable[[], bool],
        starting: AbstractContextManager[Any],
        workdir: Path,
    ) -> None:
        self.spark = spark
        self.settings = settings
        self._idle = idle  # no job runs here
        self._starting = starting  # held while a warm-up's query starts (the processor's command lock)
        self._workdir = workdir
        self._cv = threading.Condition()
        self._pending: dict[str, JobSpec] = {}
        self._warmed: set[str] = set()
        self._cancel = threading.Event()
        self._not_running = threading.Event()
        self._not_running.set()
        self._last_start = float("-inf")
        self._offered_at = float("-inf")
        self._current: str | None = None  # the shape being warmed up on
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def warmed(self) -> int:
        """How many shapes this processor has warmed up on."""
        with self._cv:
            return len(self._warmed)

    def offer(self, specs: Iterable[JobSpec]) -> int:
        """The specs of the jobs control runs, all of them: the shapes waiting for a warm-up become
        theirs (a job that ended is not warmed up on). Returns how many shapes are new."""
        if self.settings.shape_warmup_s <= 0:
            return 0
        with self._cv:
            wanted: dict[str, JobSpec] = {}
            for spec in specs:
                if spec.id.startswith(constants.WARMUP_JOB_PREFIX):
                    continue
                shape = shape_of(spec)
                if (
                    shape
                    and shape not in self._warmed
                    and shape != self._current
                    and len(wanted) < MAX_PENDING
                ):
                    wanted.setdefault(shape, spec)
            added = len(wanted.keys() - self._pending.keys())
            self._pending = wanted
            if added:
                self._offered_at = time.monotonic()
            if added and self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="shape-warmup", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return added

    def before_job_start(self) -> None:
        """A job starts here: cancel a warm-up and wait for its query to stop."""
        self._last_start = time.monotonic()
        self._cancel.set()
        if not self._not_running.wait(CANCEL_WAIT_S):
            log.warning("a shape warm-up did not stop within %.0f s; the job starts beside it", CANCEL_WAIT_S)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cancel.set()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=CANCEL_WAIT_S)

    def _next(self) -> tuple[str, JobSpec] | None:
        """The next shape to warm, once SHAPE_WARMUP_DELAY_S have passed since the specs came and
        since a job last started here, while no job runs here; None when closed."""
        with self._cv:
            while not self._closed:
                if not self._pending:
                    self._cv.wait()
                    continue
                wait_s = max(self._offered_at, self._last_start) + SHAPE_WARMUP_DELAY_S - time.monotonic()
                if wait_s > 0:
                    self._cv.wait(wait_s)
                    continue
                # Cleared before the checks: a start that cancels after this is seen by the warm-up.
                self._cancel.clear()
                if time.monotonic() - self._last_start < SHAPE_WARMUP_DELAY_S:
                    continue  # a job started in between
                if not self._idle():
                    self._cv.wait()  # jobs run here: until the next offer
                    continue
                self._not_running.clear()
                shape, spec = self._pending.popitem()
                self._current = shape
                return shape, spec
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            shape, spec = item
            try:
                warmed = warm_up(
                    self.spark,
                    self.settings,
                    seconds=self.settings.shape_warmup_s,
                    workdir=self._workdir,
                    like=spec,
                    backlog=self.settings.tuning.shape_warmup_backlog_events,
                    cancel=self._cancel,
                    starting=self._starting,
                )
            finally:
                self._not_running.set()
            with self._cv:
                self._current = None
                if self._cancel.is_set():
                    self._pending.setdefault(shape, spec)  # not warmed: again when idle
                elif len(self._warmed) < MAX_WARMED:
                    self._warmed.add(shape)
            log.debug("shape of job %s: %s", spec.id, warmed)
