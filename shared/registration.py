"""The client side of control's gRPC Registry: register at start, heartbeat with load, deregister at stop.

Every ingest, processor and sink instance runs one ``Registration`` (``start_registration``). It never
blocks or fails the service: a daemon thread retries with backoff while control is away, follows the
leader among control's replicas, and registers again when a heartbeat answers ``known=false``; with no
``SF_CONTROL_GRPC_TARGET`` it does nothing. A
processor passes ``jobs`` (the ``JobStatus`` of the jobs it runs), from which control updates job states,
and ``slots`` (its task slots, shared/slots.py), from which control places jobs.
Load (CPU and memory of the process and its children, such as a PySpark JVM, and records/s) is measured
here (``LoadMeter``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path

import grpc

from shared import constants
from shared.metrics import RECORDS_PROCESSED
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.settings import BaseServiceSettings
from shared.tls import TlsIdentity, open_channel

log = logging.getLogger(__name__)

JobsProvider = Callable[[], Iterable[pb.JobStatus]]
SlotsProvider = Callable[[], pb.TaskSlots]


def new_instance_id(service: str) -> str:
    """Unique per running instance: a restarted process is a new instance."""
    return f"{service}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _version() -> str:
    try:
        return metadata.version("streamforge")
    except metadata.PackageNotFoundError:
        return ""


class LoadMeter:
    """CPU %, resident memory and records/s of this process and its descendants, between two reads."""

    def __init__(self, service: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.clock = clock
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last = (clock(), self._cpu_seconds(self._pids()), self._records())

    def read(self, running_jobs: int = 0) -> pb.Load:
        family = self._pids()
        now, cpu, records = self.clock(), self._cpu_seconds(family), self._records()
        then, cpu_then, records_then = self._last
        self._last = (now, cpu, records)
        elapsed = max(now - then, 1e-6)
        return pb.Load(
            cpu_percent=max(0.0, 100.0 * (cpu - cpu_then) / elapsed),
            rss_bytes=self._rss_bytes(family),
            records_per_second=max(0.0, (records - records_then) / elapsed),
            running_jobs=running_jobs,
        )

    def _records(self) -> float:
        total = 0.0
        for metric in RECORDS_PROCESSED.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("service") == self.service:
                    total += sample.value
        return total

    def _pids(self) -> list[int]:
        """This process and its descendants (a PySpark driver's JVM counts as the processor's load)."""
        family = _family(_children)
        if family is None:  # a kernel without /proc/<pid>/task/<tid>/children
            family = _family(_children_by_scan())
        assert family is not None
        return family

    def _cpu_seconds(self, family: list[int]) -> float:
        total = 0
        for pid in family:
            stat = _stat_fields(pid)
            if stat is not None:
                total += int(stat[11]) + int(stat[12])  # utime, stime (fields 14 and 15 of stat)
        return total / self._tick

    def _rss_bytes(self, family: list[int]) -> int:
        total_kb = 0
        for pid in family:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
                    break
        return total_kb * 1024


def _children(pid: int) -> list[int] | None:
    """Child pids of every thread of ``pid`` ([] once it is gone); None where the kernel lacks the file.

    Reading each thread's ``children`` costs a few files per process of the family; the fallback reads
    every process's stat on the machine, at each heartbeat, in every service.
    """
    children: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return children
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            if not task.exists():
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
    return children


def _children_by_scan() -> Callable[[int], list[int]]:
    """Child pids by parent, from every process's stat (one read of the whole of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat_fields(int(entry.name))
            if stat is not None:
                children.setdefault(int(stat[1]), []).append(int(entry.name))
    return lambda pid: children.get(pid, [])


def _family(children_of: Callable[[int], list[int] | None]) -> list[int] | None:
    """This process and its descendants; None when ``children_of`` cannot tell (returns None)."""
    family, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        family.append(pid)
        children = children_of(pid)
        if children is None:
            return None
        todo.extend(children)
    return family


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is the state)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def control_targets(text: str) -> list[str]:
    """The control replicas' Registry addresses from a comma-separated list (blanks dropped)."""
    return [t.strip() for t in text.split(",") if t.strip()]


class Registration:
    """Keeps one instance registered with control until stop().

    ``target`` names every control replica (a comma-separated list, or a list); the instance talks to
    one at a time and moves to another when a call fails: the replica is gone, or it is a standby,
    which refuses with UNAVAILABLE and the leader's address (``sf-control-leader`` metadata).
    """

    def __init__(
        self,
        target: str | Sequence[str],
        service: str,
        *,
        grpc_port: int,
        metrics_port: int = 0,
        host: str = "127.0.0.1",
        instance_id: str | None = None,
        jobs: JobsProvider | None = None,
        slots: SlotsProvider | None = None,
        timeout_s: float = 3.0,
        max_backoff_s: float = 5.0,
        tls: TlsIdentity | None = None,
    ) -> None:
        self.targets = control_targets(target) if isinstance(target, str) else list(target)
        self._current = 0
        self.service = service
        self.instance = pb.ServiceInstance(
            instance_id=instance_id or new_instance_id(service),
            service=service,
            host=host,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            version=_version(),
        )
        self.jobs = jobs
        self.slots = slots
        self.tls = tls
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.interval_s = 1.0  # until control says otherwise
        self.registered = threading.Event()
        self.heartbeats_sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._meter = LoadMeter(service)

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id

    @property
    def target(self) -> str:
        """The control replica this instance talks to now ("" when none is configured)."""
        return self.targets[self._current] if self.targets else ""

    @property
    def enabled(self) -> bool:
        return bool(self.targets)

    def start(self) -> Registration:
        if not self.enabled or self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name=f"registration-{self.service}", daemon=True)
        self._thread.start()
        return self

    def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; tell control we are gone (so it reschedules without waiting a timeout)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)
        self._thread = None
        if deregister and self.registered.is_set():
            self._deregister()
        self.registered.clear()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def _deregister(self) -> None:
        """At the leader: the current replica first, then the others (it may have changed)."""
        order = self.targets[self._current :] + self.targets[: self._current]
        for target in order:
            try:
                self._stub(target).Deregister(pb.DeregisterRequest(instance_id=self.instance_id), timeout=2.0)
                return
            except grpc.RpcError as e:
                log.info("could not deregister from control at %s: %s", target, _describe(e))

    def _stub(self, target: str | None = None) -> pb_grpc.RegistryStub:
        target = target or self.target
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = open_channel(target, self.tls, expected="control")
        return pb_grpc.RegistryStub(channel)

    def _move_on(self, error: grpc.RpcError) -> None:
        """After a failed call: go to the replica the refusal names as leader, else to the next one."""
        leader = _leader_hint(error)
        if leader in self.targets and leader != self.target:
            self._current = self.targets.index(leader)
        else:
            self._current = (self._current + 1) % len(self.targets)

    def _run(self) -> None:
        backoff_s = 0.2
        failures = 0
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                else:
                    self._heartbeat()
                failures = 0
                backoff_s = 0.2
                if self.registered.is_set():
                    self._stop.wait(self.interval_s)
            except grpc.RpcError as e:
                failures += 1
                # Say it once at WARNING; a control that stays away should not flood the log.
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "control registry at %s: %s (retrying)", self.target, _describe(e))
                self._move_on(e)
                if failures % len(self.targets) == 0:  # every replica refused: wait, then go round again
                    # A registered instance keeps its pace, so it reaches a new leader within its grace.
                    registered = self.registered.is_set()
                    self._stop.wait(min(backoff_s, self.interval_s) if registered else backoff_s)
                    backoff_s = min(backoff_s * 2, self.max_backoff_s)
            except Exception:  # a bad jobs() callback must not end registration for good
                log.exception("registry heartbeat failed")
                self._stop.wait(self.interval_s)

    def _register(self) -> None:
        instance = self.instance
        if self.slots is not None:
            instance = pb.ServiceInstance()
            instance.CopyFrom(self.instance)
            instance.slots.CopyFrom(self.slots())
        reply = self._stub().Register(pb.RegisterRequest(instance=instance), timeout=self.timeout_s)
        if reply.heartbeat_interval_ms > 0:
            self.interval_s = reply.heartbeat_interval_ms / 1000
        self.registered.set()
        log.info(
            "registered with control at %s as %s (heartbeat every %.1f s)",
            self.target,
            self.instance_id,
            self.interval_s,
        )

    def _heartbeat(self) -> None:
        statuses = list(self.jobs()) if self.jobs is not None else []
        running = sum(1 for s in statuses if s.state == pb.JOB_STATE_RUNNING)
        request = pb.HeartbeatRequest(
            instance_id=self.instance_id,
            load=self._meter.read(running),
            jobs=statuses,
            slots=self.slots() if self.slots is not None else None,
        )
        reply = self._stub().Heartbeat(request, timeout=self.timeout_s)
        self.heartbeats_sent += 1
        if not reply.known:
            log.info("control does not know %s (any more): registering again", self.instance_id)
            self.registered.clear()


def start_registration(
    settings: BaseServiceSettings,
    service: str,
    *,
    grpc_port: int,
    metrics_port: int = 0,
    jobs: JobsProvider | None = None,
    slots: SlotsProvider | None = None,
    instance_id: str | None = None,
    tls: TlsIdentity | None = None,
) -> Registration:
    """Register this instance with control (``settings.control_grpc_target``: one replica or a
    comma-separated list) and keep it registered.

    Returns at once; with no control target configured the returned Registration does nothing.
    """
    registration = Registration(
        settings.control_grpc_target,
        service,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        instance_id=instance_id,
        jobs=jobs,
        slots=slots,
        tls=tls,
    )
    if not registration.enabled:
        log.info("SF_CONTROL_GRPC_TARGET is not set: %s does not register with control", service)
    return registration.start()


def _leader_hint(error: grpc.RpcError) -> str:
    """The leader's Registry a standby names in its refusal ("" if none)."""
    if not isinstance(error, grpc.Call):
        return ""
    for key, value in error.trailing_metadata() or ():
        if key == constants.CONTROL_LEADER_METADATA:
            return value if isinstance(value, str) else value.decode()
    return ""


def _describe(error: grpc.RpcError) -> str:
    if isinstance(error, grpc.Call):
        return f"{error.code().name}: {error.details()}"
    return str(error)
