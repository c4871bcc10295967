"""The instance registry: who is there, and what the processors say they run.

Instances register, heartbeat and deregister through control's gRPC Registry (``grpc_server``); one
silent for ``heartbeat_timeout_ms`` is lost (``sweep_instances``, called by the supervisor). A
processor's heartbeat lists the jobs it runs; those reports are reconciled with the job store here:
RUNNING when it runs a job control placed on it, a restart or a failure when it does not, adoption of
a job it resumed by itself, and a stop for a copy it should not run (through ``dispatch``).
"""

from __future__ import annotations

import logging

from services.control.context import ControlContext
from services.control.dispatch import Dispatcher
from services.control.errors import ControlError
from services.control.metrics import CONTROL_HEARTBEATS
from services.control.store import InstanceRecord, JobRecord
from services.control.transitions import SHOULD_RUN, STARTABLE, Transitions
from shared.jobstate import QUARANTINED, JobState
from shared.proto import streamforge_pb2 as pb
from shared.slots import Slots

log = logging.getLogger(__name__)

SERVICES = ("ingest", "processor", "sink")


def metrics_dict(status: pb.JobStatus) -> dict[str, float]:
    if not status.HasField("metrics"):
        return {}
    m = status.metrics
    return {f.name: float(getattr(m, f.name)) for f in m.DESCRIPTOR.fields}


class Registry:
    def __init__(self, ctx: ControlContext, transitions: Transitions, dispatch: Dispatcher) -> None:
        self.ctx = ctx
        self.transitions = transitions
        self.dispatch = dispatch
        # Instances were heartbeating to a previous control: give them a full timeout to find us.
        self.started_ms = ctx.clock()

    def lead(self) -> None:
        """This replica took the lead: count silence from now, since the instances were heartbeating
        to the previous leader and have to find this one."""
        self.started_ms = self.ctx.clock()

    # --- called by the gRPC Registry servicer ----------------------------------------------------------
    def register(self, instance: pb.ServiceInstance) -> int:
        """Record the instance (alive); returns the heartbeat interval it is to keep."""
        self.ctx.leader.check()
        if not instance.instance_id:
            raise ControlError("instance_id is empty: every instance needs a unique id")
        if instance.service not in SERVICES:
            raise ControlError(f"service {instance.service!r} is not one of {', '.join(SERVICES)}")
        if not 0 < instance.grpc_port < 65536:
            raise ControlError(f"grpc_port {instance.grpc_port} is not a port (1-65535)")
        now = self.ctx.clock()
        previous = self.ctx.instances.get(instance.instance_id)
        record = InstanceRecord(
            instance_id=instance.instance_id,
            service=instance.service,
            host=instance.host or "127.0.0.1",
            grpc_port=instance.grpc_port,
            metrics_port=instance.metrics_port,
            version=instance.version,
            registered_at_ms=now,
            last_heartbeat_ms=now,
            slots=Slots.of_proto(instance.slots).to_dict() if instance.HasField("slots") else {},
        )
        if previous is not None and previous.target != record.target:
            self.ctx.peers.forget(previous.target)
        if previous is None or previous.health != "alive":
            # A new process at this address (a restarted replica registers under a new id) gets a
            # fresh channel: the cached one, to the process that died there, sits in gRPC's growing
            # reconnect backoff and fails every call at once until it ends.
            self.ctx.peers.forget(record.target)
        self.ctx.instances.put(record)
        again = "" if previous is None else f" again (was {previous.health})"
        log.info("%s %s registered%s at %s", record.service, record.instance_id, again, record.target)
        self._watch(record, again=True)
        self.ctx.wake()
        return self.ctx.settings.tuning.heartbeat_interval_ms

    def heartbeat(self, request: pb.HeartbeatRequest) -> bool:
        """Record a heartbeat; False when the instance must register (again) first."""
        self.ctx.leader.check()
        now = self.ctx.clock()
        load = {f.name: float(getattr(request.load, f.name)) for f in request.load.DESCRIPTOR.fields}
        reported = list(request.jobs)
        update: dict[str, object] = {"last_heartbeat_ms": now, "load": load}
        update["jobs"] = sorted(s.job_id for s in reported)
        if request.HasField("slots"):
            update["slots"] = Slots.of_proto(request.slots).to_dict()

        def beat(r: InstanceRecord) -> InstanceRecord | None:
            if r.health != "alive":
                return None
            return r.model_copy(update=update)

        record = self.ctx.instances.update(request.instance_id, beat)
        known = record is not None and record.health == "alive"
        CONTROL_HEARTBEATS.labels("known" if known else "unknown").inc()
        if not known or record is None:
            return False
        if record.service == "processor":
            self._watch(record)  # e.g. registered with a control that has restarted since
            self._apply_reports(record, reported, now)
        return True

    def _watch(self, record: InstanceRecord, *, again: bool = False) -> None:
        """Its jobs move when a processor is lost: learn of a dead one from its closed connection
        (Peers.watch), not only from a heartbeat timeout."""
        if record.service != "processor" or not self.ctx.settings.tuning.fast_loss_detection:
            return
        if not again and self.ctx.peers.watching(record.target, "processor"):
            return
        iid = record.instance_id

        def recheck() -> None:
            self.dispatch.recheck(iid, self.lose_refused)

        self.ctx.peers.watch(record.target, "processor", recheck)

    def deregister(self, instance_id: str) -> None:
        self.ctx.leader.check()
        record = self.ctx.instances.get(instance_id)
        if record is None:
            return
        self.ctx.instances.delete(instance_id)
        self.ctx.peers.forget(record.target)
        log.info("%s %s deregistered", record.service, instance_id)
        self.ctx.wake()

    # --- called by the supervisor ----------------------------------------------------------------------
    def sweep_instances(self, now: int) -> dict[str, InstanceRecord]:
        """Mark silent instances lost, forget long-lost ones; returns the live ones by id."""
        live: dict[str, InstanceRecord] = {}
        for inst in self.ctx.instances.list():
            if inst.health == "alive":
                silent_ms = now - max(inst.last_heartbeat_ms, self.started_ms)
                if silent_ms > self.ctx.settings.heartbeat_timeout_ms:
                    self._mark_lost(inst.instance_id, now, silent_ms)
                else:
                    live[inst.instance_id] = inst
            elif now - inst.lost_at_ms > self.ctx.settings.tuning.lost_retention_ms:
                self.ctx.instances.delete(inst.instance_id)
        return live

    def _mark_lost(self, instance_id: str, now: int, silent_ms: int) -> None:
        why = f"no heartbeat for over {self.ctx.settings.heartbeat_timeout_ms} ms"

        def lose(r: InstanceRecord) -> InstanceRecord | None:
            # Re-check inside the transaction: a heartbeat may have arrived since we listed.
            if (
                r.health != "alive"
                or now - max(r.last_heartbeat_ms, self.started_ms) <= self.ctx.settings.heartbeat_timeout_ms
            ):
                return None
            return r.model_copy(update={"health": "lost", "lost_at_ms": now, "lost_reason": why})

        record = self.ctx.instances.update(instance_id, lose)
        if record is not None and record.health == "lost":
            log.warning("%s %s lost: no heartbeat for %d ms", record.service, instance_id, silent_ms)
            self._close_channels(record)

    def lose_refused(self, instance_id: str, why: str) -> None:
        """Its connection dropped and its address refuses a new one: the process is gone. Lost now,
        without waiting out the heartbeat timeout (a restarted process registers under a new id)."""
        now = self.ctx.clock()
        reason = f"its connection closed and its gRPC port refuses calls ({why})"

        def lose(r: InstanceRecord) -> InstanceRecord | None:
            if r.health != "alive":
                return None
            return r.model_copy(update={"health": "lost", "lost_at_ms": now, "lost_reason": reason})

        record = self.ctx.instances.update(instance_id, lose)
        if record is not None and record.health == "lost":
            log.warning(
                "%s %s lost: %s, %d ms after its last heartbeat",
                record.service,
                instance_id,
                reason,
                now - record.last_heartbeat_ms,
            )
            self._close_channels(record)
            self.ctx.wake()

    def _close_channels(self, lost: InstanceRecord) -> None:
        """Close the channels (and end the connection watch) to a lost instance's address, unless a
        live instance serves there now; one that comes back registers again and gets fresh ones."""
        if not any(
            i.health == "alive" and i.target == lost.target and i.instance_id != lost.instance_id
            for i in self.ctx.instances.list()
        ):
            self.ctx.peers.forget(lost.target)

    # --- what a processor's heartbeat says about the jobs -----------------------------------------------
    def _apply_reports(self, processor: InstanceRecord, reported: list[pb.JobStatus], now: int) -> None:
        by_id = {s.job_id: s for s in reported}
        alive = self.ctx.instances.alive_ids()
        for job in self.ctx.jobs.list():
            status = by_id.get(job.id)
            placed_here = job.processor == processor.instance_id
            settled = (
                now - max(job.placed_at_ms, processor.registered_at_ms) > self.ctx.settings.report_grace_ms()
            )
            if status is None:
                if placed_here and job.state == JobState.RUNNING and settled:
                    self.transitions.restart(
                        job.id, f"processor {processor.instance_id} no longer runs the job"
                    )
                continue
            state = JobState.from_proto(status.state)
            if state == JobState.RUNNING and job.state.is_final and settled:
                # Ended, yet it runs: a processor that restarted resumed a job control has given up on
                # since, or one that came back after it was placed elsewhere.
                self.dispatch.stop_stray(job.id, processor)
            elif placed_here:
                self._reconcile_report(job, state, status, now, settled)
            elif state != JobState.RUNNING:
                continue
            elif job.state in STARTABLE and job.processor not in alive:
                # A processor that restarted resumes its jobs by itself: adopt the copy it runs.
                self.transitions.adopt(job.id, processor.instance_id, now, self.ctx.instances.alive_ids)
            elif settled and job.processor in alive:
                # Placed on another live processor since (this one was lost and came back): a second
                # copy would write the same checkpoint and results.
                self.dispatch.stop_stray(job.id, processor)

    def _reconcile_report(
        self, job: JobRecord, state: JobState | None, status: pb.JobStatus, now: int, settled: bool
    ) -> None:
        metrics = metrics_dict(status)
        who = f"processor {job.processor}"
        if metrics:
            self.transitions.record_metrics(job.id, job.processor, metrics, now)
        if state == JobState.RUNNING:
            if job.state in STARTABLE:
                self.transitions.move(
                    job.id, JobState.RUNNING, f"running on {who}", only_from={job.state}, needs_start=False
                )
            return
        if not settled or state == JobState.CREATED:
            # CREATED: the processor is still starting the query (StartJob returns once it runs; a
            # heartbeat built during the start may arrive after that answer). A start that fails ends
            # FAILED or FAILING, which the branches below follow.
            return
        reason = status.message or "no reason given"
        if job.state == JobState.CANCELLING and state in (
            JobState.CANCELED,
            JobState.FINISHED,
            JobState.FAILED,
        ):
            self.transitions.finish_stop(job.id, status.savepoint_path, f"{who} reports the job {state}")
        elif state == JobState.FAILING and job.state in (JobState.RUNNING, JobState.CREATED):
            # The processor restarts the query from its checkpoint itself: follow, do not interfere.
            self.transitions.move(
                job.id, JobState.FAILING, f"{who} is restarting the job: {reason}", only_from={job.state}
            )
        elif state == JobState.FAILED and job.state in SHOULD_RUN and reason.startswith(QUARANTINED):
            # It kept killing the processor's JVM: restarting it would do that again.
            self.transitions.move(job.id, JobState.FAILED, f"{who}: {reason}", only_from={job.state})
        elif state == JobState.FAILED and job.state in SHOULD_RUN:
            if not job.needs_start:  # else: a restart is already on its way
                self.transitions.count_failure(job.id, f"{who} gave up on the job: {reason}")
        elif job.state == JobState.RUNNING:
            self.transitions.restart(job.id, f"{who} reports the job {state or 'UNSPECIFIED'}, not RUNNING")
