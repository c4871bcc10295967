"""The platform over nine hosts of one machine (net.py): what runs where, started and stopped.

Every host has its own directory under the run dir (``<run dir>/sf-h<n>/``: logs, pid files, data,
temporary files, Kafka's and Spark's directories), so hosts share nothing but the network. The run
dir itself is the operator's: the CA and certificates, Redis passwords, the Spark secret and the
control token are made there once and copied to each host before it starts anything.

Every host uses the same ports (they have an address each), the single-machine stack's defaults.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from infra.artifacts.fetch import kafka_classpath, spark_kafka_jars
from infra.cluster.kafka_cluster import KafkaCluster
from infra.cluster.spark_standalone import SparkMaster, SparkWorker, install_secret, secret, spark_conf
from infra.errors import InfraError
from infra.hosts import net
from infra.hosts.net import NetHost
from infra.local import procs
from infra.local.hdfs import DataNode, NameNode
from infra.local.redis_sentinel import RedisHA, sentinel_passwords
from infra.local.redis_server import RedisServer
from infra.local.stack import StackConfig, start_service, token_file, wait_process_ready
from infra.paths import RUN_DIR
from infra.pki import ensure_pki

# host index -> its processes. Host 1 carries what has a single copy; hosts 2 and 3 one of each
# replicated part; the active processor and its standby, the Redis primary and its replica, the two
# controls have a host each, so losing one of those hosts is one fault. The three Sentinels sit where
# a quorum outlives any one of those hosts.
LAYOUT: dict[int, tuple[str, ...]] = {
    1: ("kafka-1", "hdfs-namenode", "hdfs-datanode-1", "spark-master", "redis-sentinel-1"),
    2: ("kafka-2", "hdfs-datanode-2", "spark-worker-1", "ingest-1", "sink-1", "redis-sentinel-2"),
    3: ("kafka-3", "hdfs-datanode-3", "spark-worker-2", "ingest-2", "sink-2", "redis-sentinel-3"),
    4: ("processor-1",),
    5: ("processor-2",),
    6: ("redis-1",),
    7: ("redis-2",),
    8: ("control-1",),
    9: ("control-2",),
}
HOSTS = len(LAYOUT)
KAFKA_PORT, CONTROLLER_PORT = 9092, 9093
NAMENODE_PORT, NAMENODE_HTTP_PORT = 9820, 9870
# Every block on two of the three DataNodes: one may die and every file stays readable and writable.
HDFS_REPLICATION = 2
SPARK_PORT, SPARK_UI_PORT, WORKER_PORT, WORKER_UI_PORT = 7077, 8080, 7078, 8090
REDIS_PORT, SENTINEL_PORT = 6379, 26379
ACTIVE, STANDBY = "processor-1", "processor-2"
CONTROLS = ("control-1", "control-2")


@dataclass(frozen=True)
class HostsConfig:
    run_dir: Path = RUN_DIR / "hosts"
    broker_heap: str = "384m"
    worker_cores: int = 2
    worker_memory: str = "1g"
    app_cores: int = 2
    executor_cores: int = 1
    executor_memory: str = "512m"
    driver_memory: str = "768m"
    control_token: str = ""
    # Extra environment per service ("control", "ingest", "processor", "sink").
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


def config(**overrides: Any) -> HostsConfig:
    run_dir = Path(overrides.pop("run_dir", RUN_DIR / "hosts")).resolve()
    token = overrides.pop("control_token", "") or token_file(run_dir / "control-token")
    return HostsConfig(run_dir=run_dir, control_token=token, **overrides)


def host_of(process: str) -> NetHost:
    for index, names in LAYOUT.items():
        if process in names:
            return net.host(index)
    raise InfraError(f"no host runs {process!r}")


def hosts() -> list[NetHost]:
    return [net.host(i) for i in LAYOUT]


def host_dir(cfg: HostsConfig, h: NetHost) -> Path:
    return cfg.run_dir / h.name


def run_dir_of(cfg: HostsConfig, process: str) -> Path:
    return host_dir(cfg, host_of(process))


def stack_config(cfg: HostsConfig) -> StackConfig:
    """The platform as a client sees it (Kafka, Redis, control on their hosts), with the operator's
    run dir: the chaos harness and the tests take this."""
    kafka_hosts = [host_of(f"kafka-{i}") for i in (1, 2, 3)]
    return StackConfig(
        run_dir=cfg.run_dir,
        kafka_bootstrap=",".join(f"{h.address}:{KAFKA_PORT}" for h in kafka_hosts),
        kafka_users_dir=cfg.run_dir,  # the cluster's users, whichever host's directory a service uses
        kafka_ca_file=kafka_ca_file(cfg),
        redis_port=REDIS_PORT,
        redis_address=host_of("redis-1").address,
        redis_sentinels=redis_ha(cfg).sentinel_list,
        control_address=host_of(CONTROLS[0]).address,
        control_addresses=tuple(host_of(c).address for c in CONTROLS),
        control_token=cfg.control_token,
    )


def host_stack(cfg: HostsConfig, h: NetHost) -> StackConfig:
    """The same, for the services of host ``h``: their files under the host's directory."""
    return replace(stack_config(cfg), run_dir=host_dir(cfg, h))


def kafka_ca_file(cfg: HostsConfig) -> Path:
    """The operator's CA: Kafka traffic leaves a host here, so every listener takes TLS from it."""
    return cfg.run_dir / "pki" / "ca.crt"


def kafka(cfg: HostsConfig) -> KafkaCluster:
    nodes = [host_of(f"kafka-{i}") for i in (1, 2, 3)]
    return KafkaCluster(
        cfg.run_dir,
        [KAFKA_PORT] * 3,
        [CONTROLLER_PORT] * 3,
        cfg.broker_heap,
        hosts=nodes,
        node_run_dirs=[host_dir(cfg, h) for h in nodes],
        ca_file=kafka_ca_file(cfg),
    )


def namenode(cfg: HostsConfig) -> NameNode:
    h = host_of("hdfs-namenode")
    return NameNode(
        host_dir(cfg, h),
        host=h.address,
        netns=h.netns,
        port=NAMENODE_PORT,
        http_port=NAMENODE_HTTP_PORT,
        replication=HDFS_REPLICATION,
    )


def datanodes(cfg: HostsConfig) -> list[DataNode]:
    uri = namenode(cfg).uri
    out = []
    for i in (1, 2, 3):
        h = host_of(f"hdfs-datanode-{i}")
        out.append(DataNode(host_dir(cfg, h), uri, name=f"hdfs-datanode-{i}", host=h.address, netns=h.netns))
    return out


def state_root(cfg: HostsConfig) -> str:
    """Where the processors keep checkpoints, savepoints and their job lists: on HDFS."""
    return f"{namenode(cfg).uri}/streamforge"


def redis_ha(cfg: HostsConfig) -> RedisHA:
    """The primary (first ``redis-1``) and its replica, and three Sentinels (quorum 2), each on its
    host with that host's run dir."""
    nodes = [host_of(f"redis-{i}") for i in (1, 2)]
    sentinels = [host_of(f"redis-sentinel-{i}") for i in (1, 2, 3)]
    return RedisHA(
        cfg.run_dir,
        nodes=tuple((h, REDIS_PORT) for h in nodes),
        sentinels=tuple((h, SENTINEL_PORT) for h in sentinels),
        node_run_dirs=tuple(host_dir(cfg, h) for h in nodes),
        sentinel_run_dirs=tuple(host_dir(cfg, h) for h in sentinels),
    )


def spark_master(cfg: HostsConfig) -> SparkMaster:
    h = host_of("spark-master")
    return SparkMaster(host_dir(cfg, h), SPARK_PORT, SPARK_UI_PORT, host=h)


def spark_workers(cfg: HostsConfig) -> list[SparkWorker]:
    master = spark_master(cfg)
    out = []
    for i in (1, 2):
        h = host_of(f"spark-worker-{i}")
        out.append(
            SparkWorker(
                host_dir(cfg, h),
                i,
                master,
                WORKER_PORT,
                WORKER_UI_PORT,
                cores=cfg.worker_cores,
                memory=cfg.worker_memory,
                host=h,
            )
        )
    return out


@dataclass(frozen=True)
class Replica:
    """One service process: ``process`` names its pid file and log, ``host`` where it runs."""

    process: str
    service: str
    host: NetHost
    env: dict[str, str]
    ready_url: str


def replicas(cfg: HostsConfig) -> list[Replica]:
    """Every service process, the controls first, the standby processor last."""
    stack = stack_config(cfg)
    ha = redis_ha(cfg)
    out = []
    for process in CONTROLS:
        h = host_of(process)
        # The address the other replica names when it refuses a change, and the lease advertises.
        env = {**ha.client_env("control", wait_replicas=1), "SF_CONTROL_ADVERTISED_HOST": h.address}
        out.append(Replica(process, "control", h, env, f"http://{h.address}:{stack.control_port}/readyz"))
    for i in (1, 2):
        h = host_of(f"ingest-{i}")
        env = {"SF_INGEST_INSTANCE_ID": str(i)}  # its transactional id and static group membership
        out.append(Replica(f"ingest-{i}", "ingest", h, env, _metrics_url(h, stack.metrics_ports[0])))
    for i in (1, 2):
        h = host_of(f"sink-{i}")
        env = ha.client_env("sink", wait_replicas=1)
        out.append(Replica(f"sink-{i}", "sink", h, env, _metrics_url(h, stack.metrics_ports[2])))
    for process in (ACTIVE, STANDBY):
        h = host_of(process)
        ready = _metrics_url(h, stack.metrics_ports[1])
        out.append(Replica(process, "processor", h, processor_env(cfg, h, process), ready))
    return out


def processor_env(cfg: HostsConfig, h: NetHost, process: str) -> dict[str, str]:
    app_conf = {
        **spark_conf(cfg.run_dir),
        "spark.executor.memory": cfg.executor_memory,
        "spark.executor.cores": str(cfg.executor_cores),
        "spark.cores.max": str(cfg.app_cores),
        # Executors on the workers' hosts call the driver back at its host's address.
        "spark.driver.host": h.address,
        "spark.driver.bindAddress": h.address,
        # A write pipeline that lost a DataNode goes on with the one left rather than fail the
        # checkpoint: the third DataNode is the only replacement, and it may be the one down.
        "spark.hadoop.dfs.client.block.write.replace-datanode-on-failure.best-effort": "true",
    }
    env = {
        "SF_PROCESSOR_SPARK_MASTER": spark_master(cfg).url,
        "SF_PROCESSOR_SPARK_CONF": json.dumps(app_conf),
        "SF_PROCESSOR_DRIVER_MEMORY": cfg.driver_memory,
        "SF_PROCESSOR_JOB_SPECS": "[]",  # control places every job
        "SF_PROCESSOR_STATE_ROOT": state_root(cfg),
        "SF_PROCESSOR_NAME": process,  # its job list under the state root
    }
    return env


def _metrics_url(h: NetHost, port: int) -> str:
    return f"http://{h.address}:{port}/metrics"


def replica(cfg: HostsConfig, process: str) -> Replica:
    for r in replicas(cfg):
        if r.process == process:
            return r
    raise InfraError(f"no service process {process!r}")


def start_replica(cfg: HostsConfig, r: Replica) -> int:
    base = host_dir(cfg, r.host)
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    env = {
        "TMPDIR": str(base / "tmp"),
        "SF_DATA_DIR": str(base / "data"),
        "SF_TRACING_EXPORTER": "none",
        **r.env,
        **cfg.service_env.get(r.service, {}),
    }
    return start_service(host_stack(cfg, r.host), r.service, env, process=r.process, host=r.host)


def wait_replica(cfg: HostsConfig, r: Replica, timeout_s: float = 240) -> None:
    wait_process_ready(host_stack(cfg, r.host), r.process, r.ready_url, timeout_s)


def _provision(cfg: HostsConfig) -> None:
    """The operator's credentials, made once in the run dir, copied to every host."""
    stack = stack_config(cfg)
    ensure_pki(stack.pki_dir)
    RedisServer(cfg.run_dir).passwords()
    sentinel_passwords(cfg.run_dir / "redis-auth")
    value = secret(cfg.run_dir)
    for h in hosts():
        base = host_dir(cfg, h)
        base.mkdir(parents=True, exist_ok=True)
        for part in ("pki", "redis-auth"):
            shutil.copytree(cfg.run_dir / part, base / part, dirs_exist_ok=True)
        install_secret(base, value)


def registered(cfg: HostsConfig) -> dict[str, int]:
    """Alive instances per service, as control's registry sees them (any replica serves it; {} while
    every control is away)."""
    rows: list[dict[str, Any]] = []
    for url in stack_config(cfg).control_urls:
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


def up(cfg: HostsConfig, step: Callable[[str], None] = print, *, standby: bool = True) -> None:
    """Fresh hosts and everything on them, ready; ``standby=False`` leaves the standby processor
    for ``start_standby`` (control then places every job on the active one)."""
    step("Kafka and Spark-Kafka jars (from Maven Central once, then cached)")
    kafka_classpath()
    spark_kafka_jars()
    step(f"hosts: {', '.join(f'{h.name} {h.address}' for h in hosts())} on bridge {net.BRIDGE}")
    net.create(len(LAYOUT))
    _provision(cfg)
    ha = redis_ha(cfg)
    step(f"Redis: primary and replica on {', '.join(f'{s.host}:{s.port}' for s in ha.servers())}, "
         f"Sentinels on {ha.sentinel_list}")  # fmt: skip
    ha.start()
    k = kafka(cfg)
    step(f"Kafka: three KRaft nodes on {k.bootstrap_servers}")
    k.start()
    nn, dns = namenode(cfg), datanodes(cfg)
    step(f"HDFS: NameNode {nn.uri}, {len(dns)} DataNodes")
    nn.start()
    for d in dns:
        d.start()
    master = spark_master(cfg)
    master.start()
    ha.wait_ready(60)
    master.wait_ready(120)
    workers = spark_workers(cfg)
    for w in workers:
        w.start()
    k.wait_ready(180)
    for w in workers:
        w.wait_ready(120)
    nn.wait_ready(len(dns), 180)
    step("infrastructure ready; starting the services")
    services = [x for x in replicas(cfg) if standby or x.process != STANDBY]
    for x in services:
        start_replica(cfg, x)
    for x in services:
        wait_replica(cfg, x)
        step(f"{x.process} ready on {x.host.name}")
    want = {"ingest": 2, "sink": 2, "processor": 2 if standby else 1}
    procs.wait_for(
        lambda: all(registered(cfg).get(s, 0) >= n for s, n in want.items()),
        120,
        f"control to list {want} alive",
        procs.log_file(CONTROLS[0], run_dir_of(cfg, CONTROLS[0])),
    )


def start_standby(cfg: HostsConfig) -> None:
    r = replica(cfg, STANDBY)
    start_replica(cfg, r)
    wait_replica(cfg, r)


def down(cfg: HostsConfig) -> list[str]:
    """Every process of every host SIGKILLed, then the hosts and the bridge removed."""
    return net.destroy()


def memory(cfg: HostsConfig) -> dict[str, float]:
    """Resident memory (MiB) per host, every process of it."""
    return {
        h.name: round(sum(procs.rss_mb(p, include_children=False) for p in net.pids(h.netns)))
        for h in hosts()
    }


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    procs.wait_for(predicate, timeout_s, what, interval_s=0.25)
    return time.monotonic() - started
