"""`make cluster`: the platform past one process per service, on this machine, by one command.

- Kafka: three combined broker+controller KRaft nodes (kafka_cluster.py), replication factor 3 and
  ``min.insync.replicas`` 2 for every topic, internal ones included;
- Spark standalone: a master and two workers with their own cores and memory (spark_standalone.py);
- Redis: a primary, a replica and three Sentinels (infra/local/redis_sentinel.py), every client
  following failovers and the sink's commits and control's new jobs waiting for the replica (WAIT);
- the services' environment as the single-node stack has them (infra/local/stack.py);
- two controls on that Redis, one elected leader and one standby; every service and client lists both
  and follows the leader;
- two ingest replicas (one group, each its own instance and transactional id), two sink replicas, and
  two processors, each a Spark application on the cluster with its own job ledger and ports and the
  checkpoints on shared storage, so control can move a job from a lost processor to the other.

Everything listens on 127.0.0.1, on ports from ``base_port`` up (20600 for ``make cluster``, 20700 for
the tests), shifted by SF_TEST_PORT_OFFSET; the offsets below are the layout.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.artifacts.fetch import kafka_classpath, spark_kafka_jars
from infra.cluster.kafka_cluster import KafkaCluster
from infra.cluster.spark_standalone import SparkMaster, SparkWorker, spark_conf
from infra.errors import InfraError
from infra.local import procs
from infra.local.kafka_auth import KafkaAuth
from infra.local.prometheus import DEFAULT_INTERVALS, Intervals
from infra.local.stack import (
    StackConfig,
    redis_group,
    start_monitoring,
    start_service,
    token_file,
    wait_process_ready,
)
from infra.paths import RUN_DIR
from shared.kafka import KafkaAccess

DEMO_BASE_PORT = 20600
TEST_BASE_PORT = 20700
# Offsets within a cluster's block of 100 ports.
KAFKA, CONTROLLERS, REDIS, SPARK, CONTROL, INGEST, SINK, PROCESSOR = 0, 10, 20, 30, 40, 50, 60, 70
PROMETHEUS, ALERTMANAGER = 90, 94
MAX_BROKERS, MAX_WORKERS, MAX_REPLICAS = 10, 4, 3


@dataclass(frozen=True)
class ClusterConfig:
    run_dir: Path
    base_port: int = DEMO_BASE_PORT
    brokers: int = 3
    broker_heap: str = "448m"
    workers: int = 2
    worker_cores: int = 2  # a worker may offer more cores than the machine has: executors share them
    worker_memory: str = "1g"  # for its executors
    # Each processor is one Spark application: this many cores in all, in executors of this size.
    app_cores: int = 2
    executor_cores: int = 1
    executor_memory: str = "512m"
    driver_memory: str = "768m"
    ingest_replicas: int = 2
    sink_replicas: int = 2
    processors: int = 2
    controls: int = 2  # one leads, the others stand by
    control_token: str = ""
    # Extra environment per service ("control", "ingest", "processor", "sink"), e.g. faster heartbeats.
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    prometheus_intervals: Intervals = DEFAULT_INTERVALS

    def __post_init__(self) -> None:
        limits = {
            "brokers": (3, MAX_BROKERS),
            "workers": (1, MAX_WORKERS),
            "ingest_replicas": (1, MAX_REPLICAS),
            "sink_replicas": (1, MAX_REPLICAS),
            "processors": (1, MAX_REPLICAS),
            "controls": (1, MAX_REPLICAS),
        }
        for name, (low, high) in limits.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise InfraError(f"cluster {name} must be within {low}..{high}, got {value}")
        if not 1024 <= self.base_port <= 65535 - 100:
            raise InfraError(f"cluster base port {self.base_port} must be within 1024..65435")
        if self.executor_cores > min(self.app_cores, self.worker_cores):
            raise InfraError(
                f"executor_cores ({self.executor_cores}) must not exceed app_cores ({self.app_cores}) "
                f"or worker_cores ({self.worker_cores}): no executor could be placed"
            )

    def port(self, offset: int) -> int:
        return self.base_port + offset

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.port(KAFKA + i)}" for i in range(self.brokers))

    @property
    def kafka(self) -> KafkaAccess:
        """The cluster as ``admin``: what operators and the tests use."""
        return KafkaAuth(self.run_dir, self.kafka_ca_file).access(self.bootstrap)

    @property
    def kafka_ca_file(self) -> Path:
        """The project CA: the cluster's Kafka listeners all take SASL over TLS from it."""
        return self.run_dir / "pki" / "ca.crt"

    @property
    def control_url(self) -> str:
        """The first control's API (reads: any replica; changes: see control_urls)."""
        return f"http://127.0.0.1:{self.port(CONTROL)}"

    @property
    def control_urls(self) -> str:
        """Every control's API, comma-separated (what the SDK and the CLI take)."""
        ports = [control_ports(self, i)["api"] for i in range(1, self.controls + 1)]
        return ",".join(f"http://127.0.0.1:{port}" for port in ports)

    @property
    def control_grpc_targets(self) -> str:
        """Every control's Registry, comma-separated (SF_CONTROL_GRPC_TARGET of the services)."""
        ports = [control_ports(self, i)["grpc"] for i in range(1, self.controls + 1)]
        return ",".join(f"127.0.0.1:{port}" for port in ports)

    @property
    def state_root(self) -> Path:
        """Shared by the processors: whichever runs a job resumes or takes it over from here."""
        return self.run_dir / "data"


def config(*, tests: bool = False, offset: int | None = None, **overrides: Any) -> ClusterConfig:
    """The cluster of `make cluster` (``tests``: of tests/cluster), shifted by SF_TEST_PORT_OFFSET."""
    if offset is None:
        raw = os.environ.get("SF_TEST_PORT_OFFSET", "0")
        try:
            offset = int(raw)
        except ValueError:
            raise InfraError(f"SF_TEST_PORT_OFFSET must be a whole number, got {raw!r}") from None
    name = "cluster-test" if tests else "cluster"
    run_dir = RUN_DIR / (f"{name}-{offset}" if offset else name)
    base = (TEST_BASE_PORT if tests else DEMO_BASE_PORT) + offset
    return ClusterConfig(
        run_dir=run_dir.resolve(),
        base_port=base,
        control_token=overrides.pop("control_token", None) or token_file(run_dir / "control-token"),
        **overrides,
    )


def stack_config(cfg: ClusterConfig) -> StackConfig:
    """The single-node stack's config for what the cluster shares with it (Redis, control, the
    services' environment); replica 1's ports stand for each service, the others get their own."""
    ingest, sink, processor = ingest_ports(cfg, 1), sink_ports(cfg, 1), processor_ports(cfg, 1)
    return StackConfig(
        run_dir=cfg.run_dir,
        kafka_port=cfg.port(KAFKA),
        controller_port=cfg.port(CONTROLLERS),
        kafka_bootstrap=cfg.bootstrap,
        kafka_ca_file=cfg.kafka_ca_file,
        redis_port=cfg.port(REDIS),
        redis_replica_ports=(cfg.port(REDIS + 1),),
        redis_sentinel_ports=tuple(cfg.port(REDIS + 2 + i) for i in range(3)),
        control_port=cfg.port(CONTROL),
        control_api_urls=tuple(cfg.control_urls.split(",")),
        grpc_ports=(cfg.port(CONTROL + 1), processor["grpc"], ingest["grpc"], sink["grpc"]),
        metrics_ports=(ingest["metrics"], processor["metrics"], sink["metrics"]),
        ingest_http_port=ingest["http"],
        spark_ui_port=processor["spark_ui"],
        zipkin_port=cfg.port(99),  # not started: the cluster's services do not trace
        control_token=cfg.control_token,
        prometheus_port=cfg.port(PROMETHEUS),
        alertmanager_port=cfg.port(ALERTMANAGER),
        prometheus_intervals=cfg.prometheus_intervals,
    )


def control_ports(cfg: ClusterConfig, index: int) -> dict[str, int]:
    base = cfg.port(CONTROL + 2 * (index - 1))
    return {"api": base, "grpc": base + 1}


def ingest_ports(cfg: ClusterConfig, index: int) -> dict[str, int]:
    base = cfg.port(INGEST + 3 * (index - 1))
    return {"http": base, "grpc": base + 1, "metrics": base + 2}


def sink_ports(cfg: ClusterConfig, index: int) -> dict[str, int]:
    base = cfg.port(SINK + 2 * (index - 1))
    return {"grpc": base, "metrics": base + 1}


def processor_ports(cfg: ClusterConfig, index: int) -> dict[str, int]:
    base = cfg.port(PROCESSOR + 3 * (index - 1))
    return {"grpc": base, "metrics": base + 1, "spark_ui": base + 2}


def kafka(cfg: ClusterConfig) -> KafkaCluster:
    return KafkaCluster(
        cfg.run_dir,
        [cfg.port(KAFKA + i) for i in range(cfg.brokers)],
        [cfg.port(CONTROLLERS + i) for i in range(cfg.brokers)],
        cfg.broker_heap,
        ca_file=cfg.kafka_ca_file,
    )


def spark_master(cfg: ClusterConfig) -> SparkMaster:
    return SparkMaster(cfg.run_dir, cfg.port(SPARK), cfg.port(SPARK + 1))


def spark_workers(cfg: ClusterConfig) -> list[SparkWorker]:
    master = spark_master(cfg)
    return [
        SparkWorker(
            cfg.run_dir,
            i,
            master,
            cfg.port(SPARK + 2 * i),
            cfg.port(SPARK + 2 * i + 1),
            cores=cfg.worker_cores,
            memory=cfg.worker_memory,
        )
        for i in range(1, cfg.workers + 1)
    ]


@dataclass(frozen=True)
class Replica:
    """One service process of the cluster: ``process`` names its pid file and log (``ingest-2``)."""

    process: str
    service: str
    env: dict[str, str]
    ready_url: str


def replicas(cfg: ClusterConfig) -> list[Replica]:
    """Every service process, the controls first (the first one started leads)."""
    out = []
    for i in range(1, cfg.controls + 1):
        p = control_ports(cfg, i)
        env = {"SF_CONTROL_PORT": str(p["api"]), "SF_CONTROL_GRPC_PORT": str(p["grpc"])}
        name = "control" if i == 1 else f"control-{i}"
        out.append(Replica(name, "control", env, f"http://127.0.0.1:{p['api']}/readyz"))
    app_conf = {
        **spark_conf(cfg.run_dir),
        "spark.executor.memory": cfg.executor_memory,
        "spark.executor.cores": str(cfg.executor_cores),
        "spark.cores.max": str(cfg.app_cores),
    }
    for i in range(1, cfg.processors + 1):
        p = processor_ports(cfg, i)
        env = {
            "SF_PROCESSOR_SPARK_MASTER": spark_master(cfg).url,
            "SF_PROCESSOR_SPARK_CONF": json.dumps(app_conf),
            "SF_PROCESSOR_DRIVER_MEMORY": cfg.driver_memory,
            # Checkpoints, savepoints and each processor's own job ledger (what it ran, to resume
            # after a restart) under one state root every processor reaches.
            "SF_DATA_DIR": str(cfg.run_dir / f"processor-{i}"),
            "SF_PROCESSOR_STATE_ROOT": cfg.state_root.resolve().as_uri(),
            "SF_PROCESSOR_NAME": f"processor-{i}",
            "SF_PROCESSOR_JOB_SPECS": "[]",  # control places every job
            "SF_PROCESSOR_GRPC_PORT": str(p["grpc"]),
            "SF_PROCESSOR_METRICS_PORT": str(p["metrics"]),
            "SF_PROCESSOR_SPARK_UI_PORT": str(p["spark_ui"]),
        }
        out.append(Replica(f"processor-{i}", "processor", env, _metrics_url(p["metrics"])))
    for i in range(1, cfg.ingest_replicas + 1):
        p = ingest_ports(cfg, i)
        env = {
            "SF_INGEST_INSTANCE_ID": str(i),  # its transactional id and static group membership
            "SF_INGEST_HTTP_PORT": str(p["http"]),
            "SF_INGEST_GRPC_PORT": str(p["grpc"]),
            "SF_INGEST_METRICS_PORT": str(p["metrics"]),
        }
        out.append(Replica(f"ingest-{i}", "ingest", env, _metrics_url(p["metrics"])))
    for i in range(1, cfg.sink_replicas + 1):
        p = sink_ports(cfg, i)
        env = {"SF_SINK_GRPC_PORT": str(p["grpc"]), "SF_SINK_METRICS_PORT": str(p["metrics"])}
        out.append(Replica(f"sink-{i}", "sink", env, _metrics_url(p["metrics"])))
    return out


def replica(cfg: ClusterConfig, process: str) -> Replica:
    for r in replicas(cfg):
        if r.process == process:
            return r
    names = ", ".join(r.process for r in replicas(cfg))
    raise InfraError(f"the cluster has no process {process!r}; it has {names}")


def _metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def start_replica(cfg: ClusterConfig, r: Replica) -> int:
    env = {
        "SF_DATA_DIR": str(cfg.run_dir / "data"),
        "SF_TRACING_EXPORTER": "none",  # no Zipkin in the cluster
        "SF_CONTROL_GRPC_TARGET": cfg.control_grpc_targets,
        **r.env,
        **cfg.service_env.get(r.service, {}),
    }
    return start_service(stack_config(cfg), r.service, env, process=r.process)


def wait_replica(cfg: ClusterConfig, r: Replica, timeout_s: float = 240) -> None:
    wait_process_ready(stack_config(cfg), r.process, r.ready_url, timeout_s)


def registered(cfg: ClusterConfig) -> dict[str, int]:
    """Alive instances per service, as control's registry sees them (any replica serves it; {} while
    every control is away)."""
    rows: list[dict[str, Any]] = []
    for url in cfg.control_urls.split(","):
        req = urllib.request.Request(
            f"{url}/services", headers={"Authorization": f"Bearer {cfg.control_token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                rows = json.load(resp)["services"]
            break
        except (OSError, ValueError, KeyError):
            continue
    counts: dict[str, int] = {}
    for row in rows:
        if row.get("health") == "alive":
            counts[row["service"]] = counts.get(row["service"], 0) + 1
    return counts


def expected_instances(cfg: ClusterConfig) -> dict[str, int]:
    return {"ingest": cfg.ingest_replicas, "processor": cfg.processors, "sink": cfg.sink_replicas}


def wait_registered(cfg: ClusterConfig, timeout_s: float = 120) -> None:
    """Every replica of ingest, processor and sink alive in control's registry."""
    want = expected_instances(cfg)
    procs.wait_for(
        lambda: all(registered(cfg).get(s, 0) >= n for s, n in want.items()),
        timeout_s,
        f"control to list {want} alive",
        procs.log_file("control", cfg.run_dir),
    )


def up(cfg: ClusterConfig, step: Callable[[str], None] = print) -> None:
    """Start whatever of the topology is not running, and wait until all of it is ready."""
    step("Kafka and Spark-Kafka jars (from Maven Central once, then cached)")
    kafka_classpath()
    spark_kafka_jars()
    redis = redis_group(stack_config(cfg))
    assert redis is not None
    step(f"Redis: primary and replica on {', '.join(str(s.port) for s in redis.servers())}, Sentinels on "
         f"{redis.sentinel_list}")  # fmt: skip
    redis.start()
    k = kafka(cfg)
    step(f"Kafka: {cfg.brokers} KRaft nodes (broker+controller each) on {k.bootstrap_servers}")
    k.start()
    master = spark_master(cfg)
    step(f"Spark master on {master.url} (UI {master.webui_url})")
    master.start()
    redis.wait_ready()
    master.wait_ready(120)
    workers = spark_workers(cfg)
    for w in workers:
        step(f"Spark {w.name} on 127.0.0.1:{w.port}: {w.cores} cores, {w.memory}")
        w.start()
    k.wait_ready(180)
    for w in workers:
        w.wait_ready(120)
    missing = [r for r in replicas(cfg) if not procs.is_running(r.process, cfg.run_dir)]
    for r in missing:
        step(f"starting {r.process}")
        start_replica(cfg, r)
    for r in missing:
        wait_replica(cfg, r)
        step(f"{r.process} ready (pid {procs.pid_of(r.process, cfg.run_dir)})")
    start_monitoring(stack_config(cfg), step)
    wait_registered(cfg)


def down(cfg: ClusterConfig) -> list[str]:
    """Stop every process of the cluster: the services (all at once: none needs another to stop),
    then Spark's workers and master, Redis, Kafka."""
    stopped = procs.stop_many([r.process for r in replicas(cfg)], cfg.run_dir, timeout_s=30)
    return stopped + procs.stop_all(cfg.run_dir, timeout_s=30)


def processes(cfg: ClusterConfig) -> list[tuple[str, int | None]]:
    """(name, port it answers on) of every process of the topology, infrastructure first."""
    k, master = kafka(cfg), spark_master(cfg)
    rows: list[tuple[str, int | None]] = [(n.name, n.port) for n in k.nodes]
    redis = redis_group(stack_config(cfg))
    assert redis is not None
    rows += [(s.name, s.port) for s in redis.servers()]
    rows += [(s.name, s.port) for s in redis.sentinel_processes()]
    rows += [(master.name, master.port)]
    rows += [("prometheus", cfg.port(PROMETHEUS)), ("alertmanager", cfg.port(ALERTMANAGER))]
    rows += [(w.name, w.port) for w in spark_workers(cfg)]
    for r in replicas(cfg):
        rows.append((r.process, int(r.ready_url.split(":")[2].split("/")[0])))
    return rows


def memory(cfg: ClusterConfig) -> dict[str, float]:
    """Resident memory (MiB) of every running process; a worker's includes its executors, a
    processor's its Spark driver JVM."""
    out = {}
    for name, _ in processes(cfg):
        pid = procs.pid_of(name, cfg.run_dir)
        if pid is not None:
            out[name] = procs.rss_mb(pid)
    return out


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``predicate`` held (InfraError after timeout_s)."""
    started = time.monotonic()
    procs.wait_for(predicate, timeout_s, what, interval_s=0.25)
    return time.monotonic() - started
