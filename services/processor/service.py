"""The processor service: one SparkSession, one streaming query per job, commands over gRPC.

At start-up it resumes the jobs it ran when it last stopped (or died), then starts the jobs of its
spec files. Control starts and stops further jobs through JobCommands; a supervisor loop restarts
failed queries from their checkpoints, and one job failing never stops the others.
"""

from __future__ import annotations

import logging
import threading
import time

from opentelemetry.trace import Tracer
from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

from services.processor.errors import ProcessorError
from services.processor.grpc_server import grpc_services, to_proto
from services.processor.jobs.recovery import resume_verdicts
from services.processor.jobs.runner import JobRunner
from services.processor.metrics import JobMetricsListener
from services.processor.settings import ProcessorSettings
from services.processor.spark.scratch import Scratch, claim
from services.processor.spark.session import build_spark, preload
from services.processor.start_clock import CLOCK
from services.processor.state.storage import LocalStorage, StateStorage, is_local
from services.processor.warmup.shapes import ShapeWarmer
from services.processor.warmup.startup import warm_up
from shared.grpc_server import GrpcServices
from shared.jobspec import JobSpec
from shared.proto import streamforge_pb2 as pb

log = logging.getLogger(__name__)


def warmup_seconds(settings: ProcessorSettings, yielded: bool) -> float:
    """How long a processor that starts with nothing to run warms up before it registers: its
    ``warmup_s`` (a standby's), or ``taken_over_warmup_s`` when longer if it came back to find every
    job it ran taken over (``yielded``): a standby now, however it was configured."""
    return max(settings.warmup_s, settings.tuning.taken_over_warmup_s if yielded else 0)


def all_moved(settings: ProcessorSettings, storage: StateStorage) -> bool:
    """Whether this processor ran jobs and another took every one it would resume over since."""
    verdicts = [v.verdict for v in resume_verdicts(settings, storage) if v.verdict in ("resume", "moved")]
    return bool(verdicts) and all(v == "moved" for v in verdicts)


class Processor:
    def __init__(
        self,
        settings: ProcessorSettings,
        specs: list[JobSpec],
        jars: list[str],
        tracer: Tracer | None = None,
    ) -> None:
        ids = [s.id for s in specs]
        if len(set(ids)) != len(ids):
            raise ProcessorError(f"job ids must be unique, got {ids}")
        self.settings = settings
        self.specs = specs
        self.jars = jars
        self.tracer = tracer
        self._stop = threading.Event()
        self.spark: SparkSession | None = None
        self.runner: JobRunner | None = None
        self.warmer: ShapeWarmer | None = None
        self.scratch: Scratch | None = None

    def start(self) -> None:
        """Start Spark, resume the jobs that ran when the processor last stopped, then the spec files'."""
        s = self.settings
        # A local state root is read without a JVM: the wait comes before Spark starts. Any other
        # needs Spark's Hadoop client, so there it only decides the warm-up's length.
        local = is_local(s.state_root_uri)
        yielded = not self.specs and local and self._yield_to_takeover(LocalStorage())
        began = time.monotonic()
        self.scratch = claim(s.scratch_path)
        self.spark = build_spark(s, self.jars, self.scratch.path, CLOCK)
        log.info("Spark session up in %.1f s (master %s)", time.monotonic() - began, s.spark_master)
        # Beside the resumed jobs' starts (plans, checkpoints): what their first batches load first.
        threading.Thread(target=preload, args=(self.spark,), name="spark-preload", daemon=True).start()
        listener = JobMetricsListener(self.tracer, CLOCK)
        self.spark.streams.addListener(listener)
        self.runner = runner = JobRunner(self.spark, s, listener)
        if not local and not self.specs:
            yielded = all_moved(s, runner.storage)
        self.warmer = ShapeWarmer(self.spark, s, runner.idle, runner.command_lock, self.scratch.path)
        runner.before_start = self.warmer.before_job_start
        given = {spec.id for spec in self.specs}
        self.runner.resume_stored(skip=given)
        for spec in self.specs:
            self.runner.start(spec)  # a spec file that does not start is a start-up error
        if not self.runner.idle():
            CLOCK.mark("jobs_resumed")
        warm_s = warmup_seconds(s, yielded)
        if warm_s > 0 and self.runner.idle() and not self._stop.is_set():
            # Nothing runs here: warm the JVM before registering, so a job it takes over starts fast.
            warm_up(self.spark, s, seconds=warm_s, workdir=self.scratch.path)

    def _yield_to_takeover(self, storage: StateStorage) -> bool:
        """Wait ``taken_over_delay_s`` when every job this processor ran was taken over by another.

        Control moves the jobs of a processor it lost; when that processor comes back (a supervisor
        restarts it at once) another one is catching up on them from their checkpoints. A JVM and
        SparkSession starting take a core for seconds (more while the JIT compiles), and on shared
        cores they take it from that catch-up: the job is fresh again only once this start is done.
        Here nothing would run anyway, so it waits. True when every job was taken over (waited or not).
        """
        delay = self.settings.tuning.taken_over_delay_s
        if not all_moved(self.settings, storage):
            return False
        if delay > 0:
            log.info("every job this processor ran was taken over by another: Spark starts in %.0f s", delay)
            self._stop.wait(delay)
        return True

    def grpc_services(self) -> GrpcServices:
        """JobCommands over this processor's jobs (start() first)."""
        assert self.runner is not None and self.warmer is not None, "start() first"
        return grpc_services(self.runner, self.warmer)

    def job_statuses(self) -> list[pb.JobStatus]:
        """What ListJobs answers; heartbeats to control carry it."""
        return [to_proto(v) for v in self.runner.list()] if self.runner is not None else []

    def task_slots(self) -> pb.TaskSlots:
        """What the heartbeats advertise: the task slots and what the running jobs hold."""
        return self.runner.slots().to_proto() if self.runner is not None else pb.TaskSlots()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Supervise the jobs until stop(); start() first, close() after."""
        assert self.runner is not None
        while not self._stop.wait(1.0):
            try:
                self.runner.supervise()
            except (Py4JError, ConnectionError) as e:
                if self._stop.is_set():
                    return  # stopping: the JVM may go first
                # Spark's JVM died (out of memory, killed): the running jobs get a strike, so a job
                # that keeps killing it is quarantined when the processor comes back.
                struck = self.runner.record_crash()
                raise ProcessorError(
                    f"Spark's JVM died ({type(e).__name__}) while jobs {struck} ran; restart the processor"
                ) from e

    def close(self) -> None:
        # SIGTERM to the process group (how the stack stops services) reaches Spark's JVM too, which
        # then stops its queries by itself: a JVM already gone is a normal way to end here.
        try:
            if self.warmer is not None:
                self.warmer.close()
            if self.runner is not None:
                self.runner.shutdown()
            if self.spark is not None:
                self.spark.stop()
        except (Py4JError, ConnectionError) as e:
            log.info("Spark's JVM had already stopped (%s)", type(e).__name__)
        self.runner = None
        self.warmer = None
        self.spark = None
        if self.scratch is not None:
            self.scratch.release()
            self.scratch = None
