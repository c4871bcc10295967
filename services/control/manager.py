"""The JobManager: the job commands the REST API calls, and the supervisor that keeps jobs in line.

Control is level-triggered: the job store says what should run, heartbeats say what does, and each
sweep of the supervisor closes the gap (lost instances, jobs to start or stop, specs to push). Only
the leader among control's replicas sweeps and takes commands (``leader``). The parts, each calling
only the ones below it:

    manager      REST commands (submit, get, cancel, savepoint) and the supervisor's sweep
    registry     instances: register, heartbeat, deregister, lost; processors' job reports
    dispatch     commands to instances on a pool: StartJob, StopJob, ApplyStreams, health probes
    transitions  every change of a job record, checked against the table in ``lifecycle``
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future
from typing import Any

from confluent_kafka import KafkaException

from services.control.admission import Admission
from services.control.context import ControlContext
from services.control.dispatch import Dispatcher, active_specs, specs_digest, wait
from services.control.errors import (
    ControlError,
    JobConflict,
    JobNotFound,
    KafkaUnavailable,
    PathRefused,
    SpecRejected,
)
from services.control.leader import LeaderElection
from services.control.metrics import CONTROL_INSTANCES, CONTROL_JOBS, CONTROL_LEADER
from services.control.peers import Peers
from services.control.placement import Placement
from services.control.registry import SERVICES, Registry
from services.control.settings import ControlSettings
from services.control.store import InstanceRecord, InstanceStore, JobRecord, JobStore
from services.control.transitions import Transitions
from shared import constants
from shared.allowed_paths import refusal, under_roots
from shared.clock import Clock, wall_clock_ms
from shared.jobspec import JobSpec, Source, spec_from_json
from shared.jobstate import ACTIVE_STATES, JobState
from shared.kafka_acl import provision_job

log = logging.getLogger(__name__)


class JobManager:
    def __init__(
        self,
        settings: ControlSettings,
        jobs: JobStore,
        instances: InstanceStore,
        peers: Peers,
        leader: LeaderElection,
        clock: Clock = wall_clock_ms,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.instances = instances
        self.peers = peers
        self.leader = leader
        self.clock = clock
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_probe_ms = 0
        self._grants_for = ""  # the active jobs' specs digest once ended jobs' grants were revoked
        ctx = ControlContext(settings, jobs, instances, peers, clock, self.wake, leader)
        self.transitions = Transitions(ctx)
        self.placement = Placement(ctx)
        self.admission = Admission(settings, clock)
        self.dispatch = Dispatcher(ctx, self.transitions, self.placement)
        self.registry = Registry(ctx, self.transitions, self.dispatch)
        leader.on_change(self._leadership_changed)

    def _leadership_changed(self, term: int) -> None:
        CONTROL_LEADER.set(1 if term else 0)
        if term:
            self.registry.lead()  # instances heartbeated to the previous leader: give them time
            try:
                self.jobs.index_outputs()
            except ControlError as e:  # Redis away: the sink learns the jobs as they are stored
                log.warning("could not index the jobs' output topics for the sink: %s", e)
            self.wake()
        else:
            # Connection watches would recheck processors and mark them lost: the leader's work now.
            self.peers.close()

    # --- lifecycle of the manager itself ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name="control-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.dispatch.shutdown()

    def wake(self) -> None:
        """Sweep now rather than at the next interval (something changed)."""
        self._wake.set()

    def _supervise(self) -> None:
        interval_s = self.settings.tuning.sweep_interval_ms / 1000
        failing = False
        while not self._stopping.is_set():
            self._wake.clear()  # a wake() during the sweep below makes the next one come at once
            if not self.leader.is_leader():
                self._wake.wait(interval_s)
                continue
            try:
                self.sweep()
                if failing:
                    log.info("supervisor: sweeping again")
                failing = False
            except ControlError as e:  # e.g. Redis down: say so once, keep trying
                log.log(logging.DEBUG if failing else logging.WARNING, "supervisor: %s (retrying)", e)
                failing = True
            except Exception:  # the supervisor must outlive any one bad sweep
                log.exception("supervisor sweep failed")
            self._wake.wait(interval_s)

    # --- job commands (called by the REST API) ---------------------------------------------------------
    def check_savepoint_path(self, path: str, what: str) -> None:
        """Callers name savepoint paths the processor reads or writes: keep them under the roots."""
        if not path:
            return
        roots = self.settings.allowed_savepoint_roots()
        if not under_roots(path, roots):
            raise PathRefused(refusal(what, path, roots, "SF_CONTROL_SAVEPOINT_ROOTS"))

    def submit(
        self,
        spec: JobSpec,
        from_savepoint: str = "",
        wait_s: float = 0.0,
        *,
        trusted_savepoint: bool = False,
        owner: str = "",
    ) -> JobRecord:
        """Store the job (CREATED) placed on the processor it fits best, and start it there.

        ``trusted_savepoint``: the path came from a processor. ``owner``: the submitting token's
        digest (auth.token_owner). Overloaded (429) when the token is over its share or no live
        processor has the job's task slots free: a job that does not fit never starts.
        """
        self.leader.check()
        self.admission.count_submission(owner)
        if not trusted_savepoint:
            self.check_savepoint_path(from_savepoint, "from_savepoint")
        if spec.id.startswith(constants.WARMUP_JOB_PREFIX):
            # A processor hides such a query's metrics and drops its topics and checkpoint after.
            raise SpecRejected(
                f"id: job ids starting with {constants.WARMUP_JOB_PREFIX!r} are reserved for the "
                "processors' own warm-up job; pick another id"
            )
        with self.placement.lock:
            jobs = self.jobs.list()
            check_topics(spec, jobs)
            self.admission.check_jobs(owner, jobs)
            processors = self.instances.alive("processor")
            # No processor yet: the job waits CREATED and is placed when one registers.
            where = None
            if processors:
                where = self.placement.choose(spec.id, self.placement.need_of(spec), processors)
            self.provision(spec)  # only for a job that is admitted: a refused one leaves no topics
            self.transitions.create(spec, from_savepoint, owner=owner, processor=where)
        wait(self.dispatch.start_job(spec.id), wait_s)
        self.wake()  # ingest and the sink get the new stream
        return self.get(spec.id)

    def provision(self, spec: JobSpec) -> None:
        """The job's topics and each service's grants on them: nobody else creates topics."""
        try:
            provision_job(self.settings.kafka, spec, self.settings.topic_partitions)
        except KafkaException as e:
            raise KafkaUnavailable(f"cannot set up job {spec.id}'s Kafka topics: {e}") from e

    def get(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def cancel(self, job_id: str, wait_s: float = 0.0) -> JobRecord:
        self.leader.check()
        job = self.transitions.request_cancel(job_id, self.instances.alive_ids())
        if job.state == JobState.CANCELLING:
            wait(self.dispatch.stop_job(job_id), wait_s)
        self.wake()
        return self.get(job_id)

    def savepoint(self, job_id: str, directory: str = "", wait_s: float = 0.0) -> JobRecord:
        """Stop the job at a batch boundary with a savepoint; it ends FINISHED with savepoint_path."""
        self.leader.check()
        self.check_savepoint_path(directory, "directory")
        self.transitions.request_savepoint(job_id, directory)
        wait(self.dispatch.stop_job(job_id), wait_s)
        self.wake()
        return self.get(job_id)

    # --- the supervisor --------------------------------------------------------------------------------
    def sweep(self) -> list[Future[Any]]:
        """One pass: lost instances, jobs to start or stop, specs to push, health to probe.

        Returns the commands it scheduled (tests wait for them).
        """
        now = self.clock()
        scheduled: list[Future[Any]] = []
        live = self.registry.sweep_instances(now)
        jobs = self.jobs.list()
        self._export_gauges(jobs, live)
        has_processor = any(i.service == "processor" for i in live.values())
        for job in jobs:
            if job.state in (JobState.RUNNING, JobState.FAILING) and job.processor not in live:
                job = self._lose(job) or job
            wants_start = job.state == JobState.CREATED or (job.state == JobState.FAILING and job.needs_start)
            if wants_start and has_processor:
                scheduled.append(self.dispatch.start_job(job.id))
            elif job.state == JobState.CANCELLING:
                scheduled.append(self.dispatch.stop_job(job.id))
        digest = specs_digest(active_specs(jobs))
        for inst in live.values():
            # Ingest and the sink serve these streams; an idle processor warms up on their jobs' shapes.
            due = now - inst.streams_attempt_ms >= self.settings.tuning.retry_backoff_ms
            if inst.streams_digest != digest and due:
                scheduled.append(self.dispatch.push_streams(inst.instance_id))
        if self.settings.kafka.sasl and self._grants_for != digest:
            # Once every ingest and sink serves only the active jobs' streams, nothing reads or writes
            # an ended job's topics any more: the grants only it used go.
            serving = [i for i in live.values() if i.service in ("ingest", "sink")]
            if all(i.streams_digest == digest for i in serving):
                revoking = self.dispatch.revoke_ended_grants(digest)
                revoking.add_done_callback(self._grants_revoked)
                scheduled.append(revoking)
        if now - self._last_probe_ms >= self.settings.tuning.health_probe_interval_ms:
            self._last_probe_ms = now
            for inst in live.values():
                scheduled.append(self.dispatch.probe(inst.instance_id))
        return scheduled

    def _grants_revoked(self, revoking: Future[Any]) -> None:
        if not revoking.cancelled() and revoking.result():
            self._grants_for = revoking.result()

    def _lose(self, job: JobRecord) -> JobRecord | None:
        """The processor holding the job is gone (unless it registered again since the sweep listed)."""
        if self.instances.is_alive(job.processor):
            return None
        gone = self.instances.get(job.processor)
        return self.transitions.lose(job.id, job.processor, gone.lost_reason if gone is not None else "")

    def _export_gauges(self, jobs: list[JobRecord], live: dict[str, InstanceRecord]) -> None:
        for state in JobState:
            CONTROL_JOBS.labels(state.value).set(sum(1 for j in jobs if j.state == state))
        for service in SERVICES:
            CONTROL_INSTANCES.labels(service).set(sum(1 for i in live.values() if i.service == service))


def check_topics(spec: JobSpec, jobs: list[JobRecord]) -> None:
    """Refuse (409) a job that would disturb an active one: writing into its input (it would inject
    events there), or reading one of its raw topics another way. Ingest validates and keys a topic one
    way for every job: a second definition would be refused by every ingest, holding back every other
    job's stream updates with it."""
    for job in jobs:
        if job.id == spec.id or job.state not in ACTIVE_STATES:
            continue
        active = spec_from_json(job.spec_json)
        if spec.output_topic in active.input_topics:
            raise JobConflict(
                f"output_topic {spec.output_topic!r} is an input topic of job {job.id!r}: "
                "a job never writes into another job's input; pick another output_topic"
            )
        theirs = {s.topic: s for s in active.sources}
        for source in spec.sources:
            other = theirs.get(source.topic)
            if other is not None and other != source:
                differ = [
                    f for f in ("fields", "key", "event_time") if getattr(other, f) != getattr(source, f)
                ]
                raise JobConflict(
                    f"source: raw topic {source.topic!r} is read by job {job.id!r} with another "
                    f"{', '.join(differ) or 'definition'} ({_described(other, differ)}); ingest keys and "
                    "validates a topic one way for every job, so give this job the same source (a windowed "
                    "job can key its windows differently with group_by) or read another topic"
                )


def _described(source: Source, names: list[str]) -> str:
    shown = source.model_dump(mode="json")
    return "; ".join(f"{n}: {json.dumps(shown[n])}" for n in names)
