"""Whole hosts lost or cut off under load (infra/hosts/), judged by the chaos oracle.

The topology of infra/hosts/topology.py: nine network namespaces on one bridge, nothing shared but
the network. One chaos run (tests/chaos/harness.py: three jobs, late, bad and duplicate records) with
every job placed on the active processor (host sf-h4; the standby on sf-h5 starts once they run),
while ``HostFaults`` injects, one after another:

- ``datanode+kafka``: an HDFS DataNode and the Kafka node leading most partitions SIGKILLed
  together; both restarted once work flows again;
- ``host-loss``: every process of the active processor's host SIGKILLed; the standby resumes the
  jobs from the shared state; the host then comes back (its processor restarted, now the standby);
- ``cut``: the now active processor's host cut off the network (its bridge port down) while it keeps
  running, and restored after CUT_S; the other processor takes the jobs over;
- ``redis-host``: every process of the Redis primary's host SIGKILLed; the Sentinels promote the
  replica and every client follows; the host's Redis then comes back as the new primary's replica;
- ``control-host``: every process of the leading control's host SIGKILLed; the standby takes the
  lead and the jobs stay where they run; the host's control then comes back as the standby.

The run's verdict is the harness's: every window in Redis equals the oracle, versions never went
back, the dead-letter and late topics hold exactly the injected records. Besides, no on-update
window's count ever went down, and at the end each job runs on one processor. Timings (how long
until results flowed again after each fault) go to <run dir>/report.json and are printed (pytest -s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from infra.hosts import net
from infra.hosts import topology as hosts
from infra.hosts.net import NetHost
from infra.hosts.topology import HostsConfig
from infra.local import procs
from infra.local.stack import StackConfig, redis_client
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.tls import TlsIdentity
from tests.bench.stack import Control
from tests.chaos.__main__ import print_report
from tests.chaos.flow import Flow
from tests.chaos.harness import Faults, MonotonicWatch, Plan, run

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="hosts are network namespaces: needs root"),
]

SERVICE_ENV = {
    "control": {
        "SF_CONTROL_HEARTBEAT_TIMEOUT_MS": "4000",
        "SF_CONTROL_TUNING": json.dumps({"heartbeat_interval_ms": 500}),
    },
    # A dead sink or ingest replica's partitions move after this, not the default 10 s.
    "sink": {"SF_KAFKA_SESSION_TIMEOUT_MS": "6000"},
}
PLAN = Plan(
    events_per_job=200_000,
    rate=600,
    kills_per_service=0,
    savepoint_kill=False,
    restart_broker=False,
    restart_redis=False,
    seed=13,
    load_after_faults_s=10,
)
FAULTS = ("datanode+kafka", "host-loss", "cut", "redis-host", "control-host")
CUT_S = 60.0
GAP_S = 5.0
FLOW_TIMEOUT_S = 180.0


def _log(msg: str) -> None:
    print(f"[hosts {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@pytest.fixture(scope="module")
def topology() -> Iterator[HostsConfig]:
    net.destroy()  # a killed run's namespaces and processes
    stale = hosts.config()
    shutil.rmtree(stale.run_dir, ignore_errors=True)
    cfg = hosts.config(service_env=SERVICE_ENV)
    started = time.monotonic()
    try:
        hosts.up(cfg, _log, standby=False)
        _log(f"hosts up in {time.monotonic() - started:.0f} s")
        yield cfg
    finally:
        _write_report(cfg, {"memory_mib_per_host_at_end": hosts.memory(cfg)})
        hosts.down(cfg)


def _write_report(cfg: HostsConfig, part: dict[str, Any]) -> None:
    path = cfg.run_dir / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        report = {}
    report.update(part)
    path.write_text(json.dumps(report, indent=2))


class HostFaults(Faults):
    def __init__(
        self,
        topo: HostsConfig,
        cfg: StackConfig,
        control: Control,
        plan: Plan,
        specs: dict[str, dict[str, Any]],
        duration_s: float,
    ) -> None:
        super().__init__(cfg, control, plan, specs, duration_s)
        self.topo = topo
        self.kafka = hosts.kafka(topo)
        self.actions = list(FAULTS)
        self.gap_s = GAP_S
        self.flow = Flow(cfg.kafka, redis_client(cfg), specs, FLOW_TIMEOUT_S)
        counted = [j for j, s in specs.items() if s.get("emit") is None]
        self.counts = MonotonicWatch(redis_client(cfg), counted, "n", every_s=0.5)
        self.warmup_s: float | None = None
        self.standby_s: float | None = None

    def run(self) -> None:
        self.counts.start()
        try:
            super().run()
        finally:
            self.counts.stopped.set()
            self.flow.close()

    def _run(self) -> None:
        """The jobs warm (a new query's first micro-batches are slow), and every one of them on the
        active processor; then the standby starts and the faults begin."""
        rows = self._processors()
        assert len(rows) == 1 and sorted(rows[0]["jobs"]) == sorted(self.job_ids), rows
        began = time.monotonic()
        standby = hosts.replica(self.topo, hosts.STANDBY)
        hosts.start_replica(self.topo, standby)
        self.warmup_s = self.flow.wait_started()
        hosts.wait_replica(self.topo, standby)
        procs.wait_for(lambda: len(self._processors()) == 2, 120, "the standby processor registered")
        self.standby_s = round(time.monotonic() - began, 1)
        _log(f"jobs warm after {self.warmup_s} s, standby up in {self.standby_s} s; faults begin")
        super()._run()

    def _inject(self, action: str) -> dict[str, Any]:
        inject: dict[str, Callable[[], dict[str, Any]]] = {
            "datanode+kafka": self._kill_datanode_and_kafka_node,
            "host-loss": self._lose_active_host,
            "cut": self._cut_active_host,
            "redis-host": self._lose_redis_primary_host,
            "control-host": self._lose_leading_control_host,
        }
        measured = inject[action]()
        _log(f"{action}: {measured}")
        return measured

    # --- who runs what --------------------------------------------------------------------------
    def _processors(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.control.http.get(
            "/services", params={"service": "processor"}
        ).json()["services"]
        return [r for r in rows if r["health"] == "alive"]

    def _active(self, timeout_s: float = 60) -> tuple[str, str]:
        """(process, control's instance id) of the processor running the jobs, once control has
        every job RUNNING on one alive processor that reports them all. (A processor's report also
        lists the jobs it stopped, so a stale copy's former host is not judged by it.)"""
        rows: list[dict[str, Any]] = []

        def one() -> bool:
            status = [self.control.status(j) for j in self.job_ids]
            owners = {s["processor"] for s in status}
            if len(owners) != 1 or any(s["state"] != "RUNNING" for s in status):
                return False
            rows[:] = [r for r in self._processors() if r["instance_id"] in owners]
            return len(rows) == 1 and set(self.job_ids) <= set(rows[0]["jobs"])

        procs.wait_for(one, timeout_s, "one processor running every job")
        busy = rows
        by_address = {hosts.host_of(p).address: p for p in (hosts.ACTIVE, hosts.STANDBY)}
        return by_address[busy[0]["host"]], busy[0]["instance_id"]

    def _wait_moved(self, lost_id: str, timeout_s: float = 240) -> float:
        """Seconds until every job is RUNNING on a processor other than ``lost_id``."""
        began = time.monotonic()

        def moved() -> bool:
            status = [self.control.status(j) for j in self.job_ids]
            return all(s["state"] == "RUNNING" and s["processor"] not in ("", lost_id) for s in status)

        procs.wait_for(moved, timeout_s, f"every job RUNNING on another processor than {lost_id}")
        return time.monotonic() - began

    # --- the faults -----------------------------------------------------------------------------
    def _kill(self, process: str) -> None:
        run_dir = hosts.run_dir_of(self.topo, process)
        pid = procs.pid_of(process, run_dir)
        assert pid is not None, f"{process} is not running"
        os.killpg(pid, signal.SIGKILL)
        procs.wait_for(lambda: not procs.is_running(process, run_dir), 30, f"{process} to die")

    def _kill_datanode_and_kafka_node(self) -> dict[str, Any]:
        k = self.kafka
        metadata = k._admin().list_topics(timeout=10)
        leading = {n.node_id: 0 for n in k.nodes}
        for t in metadata.topics.values():
            for p in t.partitions.values():
                if p.leader in leading:
                    leading[p.leader] += 1
        victim = k.node(max(leading, key=lambda n: (leading[n], n)))
        datanode = hosts.datanodes(self.topo)[1]
        before = self.flow.progress()
        killed_at = time.monotonic()
        self._kill(victim.name)
        self._kill(datanode.name)
        flowing = self.flow.wait_flowing(killed_at, before)
        victim.start()
        datanode.start()
        victim.wait_ready(120)
        hosts.namenode(self.topo).wait_ready(3, 120)
        k.wait_fully_replicated(180)
        return {
            "kafka_node": victim.name,
            "led_partitions": leading[victim.node_id],
            "datanode": datanode.name,
            **flowing,
            "in_sync_s": round(time.monotonic() - killed_at, 1),
        }

    def _lose_active_host(self) -> dict[str, Any]:
        process, lost_id = self._active()
        h = hosts.host_of(process)
        before = self.flow.progress()
        killed_at = time.monotonic()
        killed = net.kill_all(h.netns)
        procs.wait_for(lambda: not net.pids(h.netns), 30, f"every process of {h.name} gone")
        self._wait_moved(lost_id)
        failover_s = round(time.monotonic() - killed_at, 1)
        flowing = self.flow.wait_flowing(killed_at, before)
        # The host comes back: its processor starts again and must leave the jobs where they are.
        r = hosts.replica(self.topo, process)
        hosts.start_replica(self.topo, r)
        hosts.wait_replica(self.topo, r)
        procs.wait_for(lambda: len(self._processors()) == 2, 120, f"{process} registered again")
        # Long enough for it to resume what its job list names, had it not been fenced off.
        time.sleep(20)
        now_active, _ = self._active()
        assert now_active != process, f"{process} took its jobs back after its host came back"
        assert not running_jobs(self.topo, process), f"{process} runs copies of jobs it lost"
        return {
            "host": h.name,
            "processes_killed": len(killed),
            "failover_s": failover_s,
            **flowing,
            "back_s": round(time.monotonic() - killed_at, 1),
        }

    def _cut_active_host(self) -> dict[str, Any]:
        process, lost_id = self._active()
        h = hosts.host_of(process)
        before = self.flow.progress()
        cut_at = time.monotonic()
        net.cut(h)
        try:
            self._wait_moved(lost_id, timeout_s=CUT_S - 5)
            failover_s = round(time.monotonic() - cut_at, 1)
            flowing = self.flow.wait_flowing(cut_at, before)
            alive_while_cut = bool(net.pids(h.netns))
            time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))
        finally:
            net.restore(h)
        restored_at = time.monotonic()
        # Back on the network it learns it lost the jobs (its heartbeats answered so, or its
        # commits refused) and stops its copies; it registers again as a standby.
        procs.wait_for(lambda: len(self._processors()) == 2, 120, f"{process} registered again")
        procs.wait_for(
            lambda: not running_jobs(self.topo, process),
            120,
            f"{process} to run none of the jobs it lost",
        )
        stale_stopped_s = round(time.monotonic() - restored_at, 1)
        now_active, _ = self._active()
        assert now_active != process, f"{process} took its jobs back after it was cut off"
        return {
            "host": h.name,
            "alive_while_cut": alive_while_cut,
            "failover_s": failover_s,
            **flowing,
            "cut_s": round(restored_at - cut_at, 1),
            "stale_copies_stopped_s": stale_stopped_s,
        }

    def _lose_host(self, process: str) -> tuple[NetHost, int]:
        h = hosts.host_of(process)
        killed = net.kill_all(h.netns)
        procs.wait_for(lambda: not net.pids(h.netns), 30, f"every process of {h.name} gone")
        return h, len(killed)

    def _lose_redis_primary_host(self) -> dict[str, Any]:
        ha = hosts.redis_ha(self.topo)
        primary = ha.primary()
        assert primary is not None, "the Sentinels name no Redis primary"
        process, _ = self._active()
        before = self.flow.progress()
        killed_at = time.monotonic()
        h, killed = self._lose_host(primary.name)

        def promoted() -> bool:
            now = ha.primary()
            return now is not None and now.name != primary.name

        procs.wait_for(promoted, 60, "the Sentinels to promote the replica", interval_s=0.25)
        promoted_s = round(time.monotonic() - killed_at, 1)
        flowing = self.flow.wait_flowing(killed_at, before)
        # The host comes back: its Redis starts as the new primary's replica and catches up.
        ha.start()
        ha.wait_ready(120)
        back = next(s for s in ha.servers() if s.name == primary.name)
        assert back.role() == "slave", f"{primary.name} came back as {back.role()}"
        now_active, _ = self._active()
        return {
            "host": h.name,
            "primary": primary.name,
            "processes_killed": killed,
            "promoted_s": promoted_s,
            **flowing,
            "jobs_stayed": now_active == process,
            "back_s": round(time.monotonic() - killed_at, 1),
        }

    def _leader(self) -> tuple[str, dict[str, Any]]:
        """(process, its GET /leader) of the control replica that says it leads."""
        for process in hosts.CONTROLS:
            url = f"http://{hosts.host_of(process).address}:{self.cfg.control_port}/leader"
            try:
                body: dict[str, Any] = httpx.get(url, timeout=2).json()
            except (httpx.HTTPError, ValueError):
                continue
            if body.get("leader"):
                return process, body
        return "", {}

    def _lose_leading_control_host(self) -> dict[str, Any]:
        leader, before_lease = self._leader()
        assert leader, "no control replica leads"
        process, _ = self._active()
        before = self.flow.progress()
        killed_at = time.monotonic()
        h, killed = self._lose_host(leader)
        procs.wait_for(lambda: self._leader()[0] not in ("", leader), 60, "the standby control to lead",
                       interval_s=0.25)  # fmt: skip
        took_over_s = round(time.monotonic() - killed_at, 1)
        new_leader, lease = self._leader()
        flowing = self.flow.wait_flowing(killed_at, before)
        # The host comes back: its control starts as the standby and leaves the lead where it is.
        r = hosts.replica(self.topo, leader)
        hosts.start_replica(self.topo, r)
        hosts.wait_replica(self.topo, r)
        now_active, _ = self._active()
        still, _ = self._leader()
        assert still == new_leader, f"the lead moved again to {still!r} when {leader} came back"
        return {
            "host": h.name,
            "leader": leader,
            "processes_killed": killed,
            "took_over_s": took_over_s,
            "term": [before_lease.get("term"), lease.get("term")],
            **flowing,
            "jobs_stayed": now_active == process,
            "back_s": round(time.monotonic() - killed_at, 1),
        }


def running_jobs(topo: HostsConfig, process: str) -> list[str]:
    """The jobs processor ``process`` says it runs (JobCommands.ListJobs, with control's certificate)."""
    stack = hosts.stack_config(topo)
    identity = TlsIdentity.load(stack.pki_dir, "control")
    target = f"{hosts.host_of(process).address}:{stack.grpc_ports[1]}"
    channel = identity.channel(target, expected="processor")
    try:
        reply = pb_grpc.JobCommandsStub(channel).ListJobs(pb.ListJobsRequest(), timeout=10)
    finally:
        channel.close()
    return sorted(j.job_id for j in reply.jobs if j.state == pb.JOB_STATE_RUNNING)


@pytest.fixture(scope="module")
def hosts_run(topology: HostsConfig) -> dict[str, Any]:
    """One chaos run with the five host faults; the tests below judge its parts."""
    cfg = topology
    made: list[HostFaults] = []

    def faults(
        cfg_: StackConfig, control: Control, plan: Plan, specs: dict[str, dict[str, Any]], duration_s: float
    ) -> Faults:
        made.append(HostFaults(cfg, cfg_, control, plan, specs, duration_s))
        return made[0]

    report = run(hosts.stack_config(cfg), PLAN, log=_log, settle_s=240, faults_factory=faults)
    f = made[0]
    report["count_regressions"] = f.counts.regressions[:20]
    report["count_reads"] = f.counts.reads
    report["warmup_s"], report["standby_s"] = f.warmup_s, f.standby_s
    report["running_after"] = {p: running_jobs(cfg, p) for p in (hosts.ACTIVE, hosts.STANDBY)}
    _write_report(cfg, {"run": report})
    print_report(report)
    for fault in report["faults"]:
        print(f"  {fault['what']}: {fault['measured']}")
    return report


def _fault(report: dict[str, Any], what: str) -> dict[str, Any]:
    done = {f["what"]: f for f in report["faults"]}
    assert what in done, report["faults"]
    fault: dict[str, Any] = done[what]
    assert not fault["error"], fault
    return fault


def _exact(report: dict[str, Any]) -> None:
    """The oracle's verdict on the results (each test judges its own fault's error)."""
    for job in report["jobs"]:
        assert job["ok"], job
    assert report["version_reads"] > 10 and not report["version_regressions"]
    assert report["count_reads"] > 10 and not report["count_regressions"]


@pytest.mark.timeout(1500)
def test_datanode_and_kafka_node_killed_under_load_every_window_exact(hosts_run: dict[str, Any]) -> None:
    fault = _fault(hosts_run, "datanode+kafka")
    assert fault["measured"]["led_partitions"] > 0
    _exact(hosts_run)


@pytest.mark.timeout(1500)
def test_active_processor_host_lost_standby_resumes_every_window_exact(hosts_run: dict[str, Any]) -> None:
    fault = _fault(hosts_run, "host-loss")
    assert fault["measured"]["processes_killed"] > 0
    _exact(hosts_run)


@pytest.mark.timeout(1500)
def test_active_processor_host_cut_off_one_writer_nothing_goes_back(hosts_run: dict[str, Any]) -> None:
    fault = _fault(hosts_run, "cut")
    assert fault["measured"]["alive_while_cut"], "the cut-off host's processes must keep running"
    assert fault["measured"]["cut_s"] >= CUT_S
    _exact(hosts_run)
    # Each job runs once, on one processor.
    running = hosts_run["running_after"]
    placed = sorted(j for jobs in running.values() for j in jobs)
    assert placed == sorted(j["job_id"] for j in hosts_run["jobs"]), running


@pytest.mark.timeout(1500)
def test_redis_primary_host_lost_replica_promoted_every_window_exact(hosts_run: dict[str, Any]) -> None:
    fault = _fault(hosts_run, "redis-host")
    assert fault["measured"]["processes_killed"] > 0
    assert fault["measured"]["jobs_stayed"], "a Redis failover must not move the jobs"
    _exact(hosts_run)


@pytest.mark.timeout(1500)
def test_leading_control_host_lost_standby_leads_every_window_exact(hosts_run: dict[str, Any]) -> None:
    fault = _fault(hosts_run, "control-host")
    assert fault["measured"]["processes_killed"] > 0
    assert fault["measured"]["jobs_stayed"], "a change of control leader must not move the jobs"
    _exact(hosts_run)
