"""Faults in the cluster topology (infra/cluster/topology.py), under load, judged by the chaos oracle.

One topology for the module: three Kafka nodes (RF 3, min ISR 2), a Spark master with two workers,
Redis, control, two ingest, two sink and two processor replicas. The chaos harness
(tests/chaos/harness.py) runs its three jobs (tumbling, sliding, session; late, bad and duplicate
records) over paced load while ``ClusterFaults`` kills a process of each kind, one after another. The
verdict is the harness's: every window in Redis equals the oracle (nothing lost, nothing counted
twice), versions never went back, the dead-letter and late topics hold exactly the injected records.
Timings go to <run dir>/report.json and are printed (pytest -s shows them).
Last, an operator job (transformWithState, Python workers on the standalone workers) runs exact.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from infra.cluster import topology as cluster
from infra.cluster.topology import ClusterConfig
from infra.local import procs
from infra.local.stack import StackConfig, redis_client
from shared.kafka import client_config
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc
from shared.tls import TlsIdentity
from tests.bench.stack import Control
from tests.chaos.__main__ import print_report
from tests.chaos.flow import INGEST_GROUP, Flow
from tests.chaos.harness import BASE_MS, Faults, Plan, run

pytestmark = pytest.mark.e2e

# Faster failure detection than the defaults, as in tests/e2e/test_control_failover.py.
SERVICE_ENV = {
    "control": {
        "SF_CONTROL_HEARTBEAT_TIMEOUT_MS": "4000",
        "SF_CONTROL_TUNING": json.dumps({"heartbeat_interval_ms": 500}),
    }
}
# 600 events/s over the three jobs until the faults are over and 10 s more (at most 600,000 events,
# 1,000 s: a ceiling far above what the faults take, so a slow, loaded machine lengthens the load
# instead of ending it before the last fault has recovered; unsent records are not judged).
PLAN = Plan(
    events_per_job=200_000,
    rate=600,
    kills_per_service=0,
    savepoint_kill=False,
    restart_broker=False,
    restart_redis=False,
    seed=12,
    load_after_faults_s=10,
)
FAULTS = ("ingest", "sink", "broker", "spark-worker", "processor")
GAP_S = 8.0  # between one fault's recovery and the next kill
FLOW_TIMEOUT_S = 180.0
SINK_GROUP = "sf-sink"


def _log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@pytest.fixture(scope="module")
def topology() -> Iterator[ClusterConfig]:
    stale = cluster.config(tests=True)
    cluster.down(stale)
    shutil.rmtree(stale.run_dir, ignore_errors=True)
    cfg = cluster.config(tests=True, service_env=SERVICE_ENV)
    started = time.monotonic()
    try:
        cluster.up(cfg, _log)
        _log(f"topology up in {time.monotonic() - started:.0f} s")
        yield cfg
    finally:
        _write_report(cfg, {"memory_mib_at_end": _memory(cfg)})
        cluster.down(cfg)


def _write_report(cfg: ClusterConfig, part: dict[str, Any]) -> None:
    path = cfg.run_dir / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        report = {}
    report.update(part)
    path.write_text(json.dumps(report, indent=2))


def _memory(cfg: ClusterConfig) -> dict[str, float]:
    rows = {name: round(mib) for name, mib in cluster.memory(cfg).items()}
    return {**rows, "total": sum(rows.values())}


def _admin(cfg: ClusterConfig) -> AdminClient:
    return AdminClient({**client_config(cfg.kafka), "socket.timeout.ms": 5000})


def test_topology_replicates_topics_and_spreads_work_over_the_cluster(topology: ClusterConfig) -> None:
    cfg = topology
    k = cluster.kafka(cfg)
    assert k.live_brokers() == [1, 2, 3]
    assert not k.under_replicated()
    admin = _admin(cfg)
    metadata = admin.list_topics(timeout=10)
    # Ingest ran init_transactions and joined its group at start: both internal topics exist.
    internal = ["__consumer_offsets", "__transaction_state"]
    for topic in internal:
        partitions = metadata.topics[topic].partitions.values()
        assert partitions and all(len(p.replicas) == 3 and len(p.isrs) == 3 for p in partitions), topic
    # A topic made the way the services make theirs (shared.kafka.ensure_topics) gets the cluster's
    # replication factor and min ISR, not 1.
    from shared.kafka import ensure_topics

    ensure_topics(cfg.kafka, ["cluster-probe"], partitions=2)
    # Metadata right after creation may not list the partitions yet: ask until it does.
    procs.wait_for(
        lambda: (
            [
                len(p.replicas)
                for p in admin.list_topics("cluster-probe", timeout=10)
                .topics["cluster-probe"]
                .partitions.values()
            ]
            == [3, 3]
        ),
        30,
        "cluster-probe with two partitions of three replicas",
    )
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in ["cluster-probe", *internal]]
    min_isr: dict[str, str] = {}

    def described() -> bool:
        # Any broker may answer, and one that has not yet heard of the new topic answers "unknown
        # topic": ask until every topic is described.
        answers = admin.describe_configs(resources).items()
        min_isr.update({r.name: f.result()["min.insync.replicas"].value for r, f in answers})
        return True

    procs.wait_for(described, 30, "the topics' configs")
    assert min_isr == {r.name: "2" for r in resources}

    master = cluster.spark_master(cfg)
    assert len(master.alive_workers()) == 2
    apps = master.applications()
    assert [a["name"] for a in apps] == ["streamforge-processor"] * 2
    assert all(a["cores"] == cfg.app_cores for a in apps), apps
    for worker in cluster.spark_workers(cfg):
        # One executor of each processor on each worker (spread out, one core each).
        procs.wait_for(
            lambda w=worker: sorted(e.split("/")[0] for e in w.executors()) == sorted(a["id"] for a in apps),
            60,
            f"an executor of each processor on {worker.name}",
        )
    assert cluster.registered(cfg) == {"ingest": 2, "processor": 2, "sink": 2}
    _write_report(cfg, {"memory_mib_idle": _memory(cfg)})


class ClusterFaults(Faults):
    """The five cluster faults in sequence, each a SIGKILL followed by a wait until work flows again
    everywhere (the ingest group's committed offset of every raw topic and the counts in Redis of the
    two jobs that emit on update have all grown):

    - an ingest replica (the one owning most raw partitions): the other takes its partitions over once
      its session times out; then it is restarted with the same instance id (its transactional id);
    - a sink replica: the other takes its partitions of the output topic over;
    - a Kafka node (the one leading most partitions): the two others keep every partition writable
      (min ISR 2); then it is restarted and catches up until no partition is under-replicated;
    - a Spark worker with its executors: the processors' queries carry on with their executors on the
      other worker; then it is restarted and the applications get their cores back;
    - a processor (the one running most jobs): control marks it lost and starts its jobs on the other
      processor, which resumes them from the shared checkpoints; then the killed one is restarted and
      must not take them back (control stops the copies it resumes on its own).
    """

    def __init__(
        self,
        topo: ClusterConfig,
        cfg: StackConfig,
        control: Control,
        plan: Plan,
        specs: dict[str, dict[str, Any]],
        duration_s: float,
    ) -> None:
        super().__init__(cfg, control, plan, specs, duration_s)
        self.topo = topo
        self.kafka = cluster.kafka(topo)  # one object: one admin client for the whole run
        self.actions = list(FAULTS)
        self.gap_s = GAP_S
        self.admin = _admin(topo)
        self.flow = Flow(topo.kafka, redis_client(cfg), specs, FLOW_TIMEOUT_S)
        self.warmup_s: float | None = None

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.flow.close()

    def _run(self) -> None:
        """First the jobs' warm-up: a new stateful query's first micro-batches are slow, which would
        count as the first fault's recovery."""
        self.warmup_s = self.flow.wait_started()
        _log(f"jobs warm after {self.warmup_s} s; faults begin")
        super()._run()

    # --- the faults ----------------------------------------------------------------------------
    def _inject(self, action: str) -> dict[str, Any]:
        inject: dict[str, Callable[[], dict[str, Any]]] = {
            "ingest": lambda: self._kill_replica("ingest", INGEST_GROUP),
            "sink": lambda: self._kill_replica("sink", SINK_GROUP),
            "broker": self._kill_broker,
            "spark-worker": self._kill_worker,
            "processor": self._kill_processor,
        }
        measured = inject[action]()
        _log(f"{action}: {measured}")
        return measured

    def _kill(self, process: str) -> float:
        pid = procs.pid_of(process, self.topo.run_dir)
        assert pid is not None, f"{process} is not running"
        os.killpg(pid, signal.SIGKILL)  # the process and its children (a driver's JVM, executors)
        killed_at = time.monotonic()
        procs.wait_for(lambda: not procs.is_running(process, self.topo.run_dir), 30, f"{process} to die")
        return killed_at

    def _members(self, group: str) -> dict[str, list[str]]:
        """member (group instance id, else member id) -> its partitions."""
        description = self.admin.describe_consumer_groups([group])[group].result(10)
        return {
            m.group_instance_id or m.member_id: sorted(
                f"{tp.topic}/{tp.partition}" for tp in m.assignment.topic_partitions
            )
            for m in description.members
        }

    def _kill_replica(self, service: str, group: str) -> dict[str, Any]:
        names = [r.process for r in cluster.replicas(self.topo) if r.service == service]
        members = self._members(group)
        assert len(members) == len(names), f"{group} has members {members}, not one per {names}"
        if service == "ingest":
            # Static members: group instance id sf-ingest-<instance id> -> ingest-<instance id>.
            owned = {f"ingest-{m.rsplit('-', 1)[1]}": parts for m, parts in members.items()}
            victim = max(owned, key=lambda n: (len(owned[n]), n))
            partitions = owned[victim]
        else:
            # Dynamic members do not say which process they are: every one owns some, so the victim does.
            assert all(members.values()), f"a {service} replica owns nothing: {members}"
            victim, partitions = names[0], sorted(p for parts in members.values() for p in parts)
        assert partitions, f"{victim} owns nothing to take over: {members}"
        killed_at = self._kill(victim)
        flowing = self.flow.wait_flowing(killed_at)
        r = cluster.replica(self.topo, victim)
        cluster.start_replica(self.topo, r)
        cluster.wait_replica(self.topo, r)
        restarted_s = round(time.monotonic() - killed_at, 1)
        procs.wait_for(lambda: len(self._members(group)) == len(names), 120, f"{victim} back in {group}")
        return {
            "victim": victim,
            "owned": partitions,
            **flowing,
            "restarted_s": restarted_s,
            "rejoined_s": round(time.monotonic() - killed_at, 1),
        }

    def _kill_broker(self) -> dict[str, Any]:
        k = self.kafka
        metadata = self.admin.list_topics(timeout=10)
        leading = {n.node_id: 0 for n in k.nodes}
        for t in metadata.topics.values():
            for p in t.partitions.values():
                if p.leader in leading:
                    leading[p.leader] += 1
        victim = k.node(max(leading, key=lambda n: (leading[n], n)))
        killed_at = self._kill(victim.name)
        procs.wait_for(lambda: victim.node_id not in k.live_brokers(), 60, f"{victim.name} fenced")
        fenced_s = round(time.monotonic() - killed_at, 1)
        flowing = self.flow.wait_flowing(killed_at)
        victim.start()
        victim.wait_ready(120)
        restarted_s = round(time.monotonic() - killed_at, 1)
        k.wait_fully_replicated(180)
        return {
            "victim": victim.name,
            "led_partitions": leading[victim.node_id],
            "fenced_s": fenced_s,
            **flowing,
            "restarted_s": restarted_s,
            "in_sync_s": round(time.monotonic() - killed_at, 1),
        }

    def _kill_worker(self) -> dict[str, Any]:
        master = cluster.spark_master(self.topo)
        victim = cluster.spark_workers(self.topo)[0]
        executors: list[str] = []

        def found() -> bool:
            executors[:] = victim.executors()  # OSError (a slow web UI) counts as not yet
            return bool(executors)

        procs.wait_for(found, 60, f"{victim.name}'s executors")
        killed_at = self._kill(victim.name)
        procs.wait_for(lambda: not victim.registered(), 60, f"the master to drop {victim.name}")
        dropped_s = round(time.monotonic() - killed_at, 1)
        flowing = self.flow.wait_flowing(killed_at)
        cores_during = [a["cores"] for a in master.applications()]
        victim.start()
        victim.wait_ready(120)
        procs.wait_for(
            lambda: all(a["cores"] == self.topo.app_cores for a in master.applications()),
            120,
            "every processor's Spark application to get its cores back",
        )
        return {
            "victim": victim.name,
            "executors_killed": executors,
            "dropped_s": dropped_s,
            **flowing,
            "app_cores_during": cores_during,
            "cores_back_s": round(time.monotonic() - killed_at, 1),
        }

    def _processors(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.control.http.get(
            "/services", params={"service": "processor"}
        ).json()["services"]
        return [r for r in rows if r["health"] == "alive"]

    def _states(self, job_id: str) -> list[str]:
        return [h["state"] for h in self.control.http.get(f"/jobs/{job_id}").json()["history"]]

    def _kill_processor(self) -> dict[str, Any]:
        by_port = {
            cluster.processor_ports(self.topo, i)["grpc"]: f"processor-{i}"
            for i in range(1, self.topo.processors + 1)
        }
        rows = self._processors()
        assert len(rows) == 2, rows
        busiest = max(rows, key=lambda r: (len(r["jobs"]), r["instance_id"]))
        victim, jobs, lost_id = by_port[busiest["grpc_port"]], list(busiest["jobs"]), busiest["instance_id"]
        assert jobs, f"no processor runs a job: {rows}"
        killed_at = self._kill(victim)

        def moved() -> bool:
            status = [self.control.status(j) for j in jobs]
            return all(s["state"] == "RUNNING" and s["processor"] not in ("", lost_id) for s in status)

        procs.wait_for(moved, 240, f"jobs {jobs} RUNNING on the other processor", interval_s=0.5)
        failover_s = round(time.monotonic() - killed_at, 1)
        flowing = self.flow.wait_flowing(killed_at)
        r = cluster.replica(self.topo, victim)
        cluster.start_replica(self.topo, r)
        cluster.wait_replica(self.topo, r)
        procs.wait_for(lambda: len(self._processors()) == 2, 120, f"{victim} registered again")
        restarted_s = round(time.monotonic() - killed_at, 1)
        # The restarted processor finds its old jobs' checkpoints held by the other one: it waits,
        # then starts with none and warms up as a standby (ProcessorTuning.taken_over_*). Should a
        # copy start anyway, control must stop it and leave the jobs where it placed them.
        time.sleep(5)
        assert moved(), [self.control.status(j) for j in jobs]
        history = {
            j: [h["state"] for h in self.control.http.get(f"/jobs/{j}").json()["history"]] for j in jobs
        }
        return {
            "victim": victim,
            "jobs": jobs,
            "failover_s": failover_s,
            **flowing,
            "restarted_s": restarted_s,
            "history": history,
        }


@pytest.mark.timeout(1800)
def test_broker_worker_processor_ingest_and_sink_killed_under_load_every_window_exact(
    topology: ClusterConfig,
) -> None:
    cfg = topology
    stack = cluster.stack_config(cfg)

    def faults(
        cfg_: StackConfig, control: Control, plan: Plan, specs: dict[str, dict[str, Any]], duration_s: float
    ) -> Faults:
        return ClusterFaults(cfg, cfg_, control, plan, specs, duration_s)

    report = run(stack, PLAN, log=_log, settle_s=240, faults_factory=faults)
    _write_report(cfg, {"run": report})
    print_report(report)
    done = {f["what"]: f for f in report["faults"]}
    assert list(done) == list(FAULTS), report["faults"]
    assert not any(f["error"] for f in report["faults"]), report["faults"]
    # Every fault began and recovered while the load ran (its last records were acknowledged at
    # load_seconds), the last one some seconds before the load ended.
    last = report["faults"][-1]
    assert last["at_s"] + last["recovered_s"] < report["load_seconds"], report
    for job in report["jobs"]:
        assert job["ok"], job
        assert job["dead_letters"][0] > 0 and job["late"][0] > 0  # the input exercised both
    assert report["version_reads"] > 10 and not report["version_regressions"]
    assert report["verdict"] == "PASS"
    # The processor's jobs went FAILING when it was lost, then RUNNING on the other processor.
    for job, states in done["processor"]["measured"]["history"].items():
        assert states[-2:] == ["FAILING", "RUNNING"], (job, states)
    # Each job runs once: asked over gRPC (as control asks), every processor runs only the jobs control
    # placed on it; the copies the restarted processor resumed by itself were stopped.
    running = {name: running_jobs(cfg, i) for i, name in enumerate(("processor-1", "processor-2"), start=1)}
    assert sorted(j for jobs in running.values() for j in jobs) == sorted(j["job_id"] for j in report["jobs"])
    _write_report(cfg, {"running_after": running})


def running_jobs(cfg: ClusterConfig, index: int) -> list[str]:
    """The jobs processor ``index`` says it runs (JobCommands.ListJobs, with control's certificate)."""
    identity = TlsIdentity.load(cluster.stack_config(cfg).pki_dir, "control")
    target = f"127.0.0.1:{cluster.processor_ports(cfg, index)['grpc']}"
    channel = identity.channel(target, expected="processor")
    try:
        reply = pb_grpc.JobCommandsStub(channel).ListJobs(pb.ListJobsRequest(), timeout=10)
    finally:
        channel.close()
    return sorted(j.job_id for j in reply.jobs if j.state == pb.JOB_STATE_RUNNING)


def test_an_operator_job_runs_on_the_spark_cluster_exact(topology: ClusterConfig) -> None:
    """A process job (the shipped ``running_total``, found through its entry point in the executors'
    Python workers on the standalone workers) gives every key's exact total through control."""
    cfg = topology
    stack = cluster.stack_config(cfg)
    job_id = f"operator-{uuid.uuid4().hex[:8]}"
    spec = {
        "id": job_id,
        "source": {
            "topic": job_id,
            "fields": {"k": "string", "value": "double", "ts": "timestamp"},
            "key": ["k"],
            "event_time": {"field": "ts"},
        },
        "watermark": {"max_out_of_orderness": "2s"},
        "process": {"operator": "running_total", "params": {"field": "value"}},
        "trigger_interval": "500ms",
    }
    rng = random.Random(55)
    events = [
        {"k": f"k{rng.randrange(7)}", "value": rng.randint(-500, 500) / 4, "ts": BASE_MS + i * 10}
        for i in range(4_000)
    ]
    counts = Counter(str(e["k"]) for e in events)
    totals = {k: math.fsum(float(str(e["value"])) for e in events if e["k"] == k) for k in counts}
    with Control(stack) as control:
        control.submit(spec)
        try:
            producer = Producer({**client_config(cfg.kafka), "enable.idempotence": True, "linger.ms": 5})
            for e in events:
                producer.produce(job_id, value=orjson.dumps(e))
            assert producer.flush(60) == 0

            def newest() -> dict[str, dict[str, Any]]:
                resp = control.http.get(f"/jobs/{job_id}/results", params={"limit": 100_000})
                resp.raise_for_status()
                latest: dict[str, dict[str, Any]] = {}
                for r in resp.json()["results"]:
                    if r["key"] not in latest or r["version"] > latest[r["key"]]["version"]:
                        latest[r["key"]] = r
                return latest

            def caught_up() -> bool:
                got = newest()
                return set(got) == set(counts) and all(
                    got[k]["aggregates"]["events"] == counts[k] for k in counts
                )

            procs.wait_for(caught_up, 240, f"every key's last running total of {job_id}")
            got = newest()
            assert {k: round(float(r["aggregates"]["total"]), 6) for k, r in got.items()} == {
                k: round(t, 6) for k, t in totals.items()
            }
            assert control.status(job_id)["state"] == "RUNNING"
        finally:
            control.cancel(job_id)
