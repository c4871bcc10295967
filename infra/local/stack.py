"""The whole platform on one machine: broker, Redis and the four services as separate processes.

`make demo` and the end-to-end tests start the same stack through this module, on different ports
and run directories, so a test run never disturbs a running demo.
"""

from __future__ import annotations

import json
import secrets
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infra.artifacts.class_archive import processor_jvm_settings
from infra.artifacts.fetch import spark_kafka_jars
from infra.errors import InfraError
from infra.local import procs
from infra.local.alertmanager import DEFAULT_GROUPING, Alertmanager, Grouping
from infra.local.kafka_auth import KafkaAuth
from infra.local.kafka_broker import DEFAULT_HEAP, KafkaBroker
from infra.local.monitoring_auth import MonitoringAuth
from infra.local.prometheus import DEFAULT_INTERVALS, Intervals, PrometheusServer
from infra.local.redis_sentinel import MASTER_NAME, RedisHA, sentinel_passwords
from infra.local.redis_server import RedisServer
from infra.local.zipkin import SPANS_PATH as ZIPKIN_SPANS_PATH
from infra.local.zipkin import ZipkinServer
from infra.paths import ROOT, RUN_DIR
from infra.pki import ensure_pki
from shared.jobspec import load_job_spec
from shared.kafka import KafkaAccess
from shared.kafka_acl import ADMIN, SERVICE_USERS, provision_job
from shared.settings import kafka_env

if TYPE_CHECKING:
    import redis

SERVICES = ("ingest", "processor", "sink", "control")


@dataclass(frozen=True)
class StackConfig:
    run_dir: Path = RUN_DIR / "demo"
    kafka_port: int = 9092
    controller_port: int = 9093
    redis_port: int = 6379
    control_port: int = 8081
    spark_ui_port: int = 4040
    # Prometheus ports of ingest, processor and sink, in that order.
    metrics_ports: tuple[int, int, int] = (9101, 9102, 9103)
    # gRPC ports of control, processor, ingest and sink, in that order (control messages only).
    grpc_ports: tuple[int, int, int, int] = (6123, 6124, 6125, 6126)
    ingest_http_port: int = 8082
    # gRPC, Prometheus and Spark UI ports of a second processor (start_standby_processor), if one runs.
    standby_processor_ports: tuple[int, int, int] = (6127, 9104, 4041)
    # HDFS where the stack runs one (the containers' kube play): the NameNode's RPC port; its HTTP and
    # a DataNode's data, IPC and HTTP ports are the four after it (as in hdfs.single_machine).
    hdfs_port: int = 9820
    job_specs: tuple[Path, ...] = field(default=())
    kafka_heap: str = DEFAULT_HEAP
    # Zipkin: tracing UI and span collector (its API and UI share the port).
    zipkin_port: int = 9411
    # A bearer token with read and write scopes for the control API; empty: no tokens, so control
    # refuses every write and serves reads openly (its secure default).
    control_token: str = ""
    # The bootstrap list when Kafka is a cluster of its own (infra/cluster/); empty: the stack's one
    # broker on kafka_port.
    kafka_bootstrap: str = ""
    # Kafka with SASL/SCRAM and ACLs (the default); False: a broker that accepts anyone (benchmarks
    # of what authentication costs).
    kafka_authenticated: bool = True
    # Where Kafka's users are kept (kafka-auth/) when not under run_dir: a cluster's, shared by the
    # services of every host.
    kafka_users_dir: Path | None = None
    # The CA certificate Kafka's listeners are signed by (infra/pki.py) when they take TLS: clients
    # then speak SASL_SSL and trust only it; None: SASL_PLAINTEXT (one machine's loopback).
    kafka_ca_file: Path | None = None
    # Redis with high availability (infra/local/redis_sentinel.py): the replicas' and the Sentinels'
    # ports, beside the primary on redis_port; empty: one Redis on redis_port.
    redis_replica_ports: tuple[int, ...] = ()
    redis_sentinel_ports: tuple[int, ...] = ()
    # Prometheus and Alertmanager (start_monitoring); they need control_token, as control takes their
    # tokens only beside one.
    prometheus_port: int = 9090
    alertmanager_port: int = 9094
    prometheus_intervals: Intervals = DEFAULT_INTERVALS
    alert_grouping: Grouping = DEFAULT_GROUPING
    # Where Redis and control listen when they run on hosts of their own (infra/hosts/): the first
    # Redis primary and control replica, the Sentinels (host:port, comma-separated; empty: those of
    # redis_group, if any) and every control replica's address (empty: control_address alone).
    redis_address: str = "127.0.0.1"
    control_address: str = "127.0.0.1"
    redis_sentinels: str = ""
    control_addresses: tuple[str, ...] = ()
    # Replicas on one address with ports of their own (the cluster): their APIs, when not all on control_port.
    control_api_urls: tuple[str, ...] = ()

    @property
    def bootstrap(self) -> str:
        return self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}"

    def kafka_auth(self) -> KafkaAuth | None:
        if not self.kafka_authenticated:
            return None
        return KafkaAuth(self.kafka_users_dir or self.run_dir, self.kafka_ca_file)

    @property
    def kafka(self) -> KafkaAccess:
        """Kafka as ``admin``: what operators, the demo and the tests use."""
        return self.kafka_access()

    def kafka_access(self, user: str = ADMIN) -> KafkaAccess:
        """How ``user`` reaches Kafka (``admin``: operators, the demo, the tests; services get users of
        their own)."""
        auth = self.kafka_auth()
        return auth.access(self.bootstrap, user) if auth is not None else KafkaAccess(self.bootstrap)

    @property
    def redis_url(self) -> str:
        """Redis as its default (all-powerful) user: operators, the demo, the tests; services get
        users of their own."""
        group = redis_group(self)
        return group.url() if group is not None else redis_server(self).url()

    @property
    def control_url(self) -> str:
        return f"http://{self.control_address}:{self.control_port}"

    @property
    def control_urls(self) -> list[str]:
        """Every control replica's API: a client sends changes to whichever leads."""
        if self.control_api_urls:
            return list(self.control_api_urls)
        return [f"http://{a}:{self.control_port}" for a in self.control_addresses or (self.control_address,)]

    @property
    def control_grpc_targets(self) -> str:
        """Every control replica's Registry, comma-separated (SF_CONTROL_GRPC_TARGET)."""
        addresses = self.control_addresses or (self.control_address,)
        return ",".join(f"{a}:{self.grpc_ports[0]}" for a in addresses)

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    @property
    def pki_dir(self) -> Path:
        """The stack's CA and service certificates for mutual TLS on gRPC (infra/pki.py)."""
        return self.run_dir / "pki"

    @property
    def zipkin_url(self) -> str:
        return f"http://127.0.0.1:{self.zipkin_port}"


def broker(cfg: StackConfig) -> KafkaBroker:
    return KafkaBroker(
        cfg.run_dir,
        port=cfg.kafka_port,
        controller_port=cfg.controller_port,
        heap=cfg.kafka_heap,
        authenticated=cfg.kafka_authenticated,
        auth=cfg.kafka_auth(),
    )


def redis_server(cfg: StackConfig) -> RedisServer:
    return RedisServer(cfg.run_dir, port=cfg.redis_port, host=procs.Host(cfg.redis_address))


def redis_group(cfg: StackConfig) -> RedisHA | None:
    """The primary, replicas and Sentinels when the stack has replicas; None for one Redis."""
    if not cfg.redis_replica_ports:
        return None
    return RedisHA(
        cfg.run_dir,
        nodes=tuple(("127.0.0.1", p) for p in (cfg.redis_port, *cfg.redis_replica_ports)),
        sentinels=tuple(("127.0.0.1", p) for p in cfg.redis_sentinel_ports),
    )


def sentinels(cfg: StackConfig) -> str:
    """The Sentinels' host:port, comma-separated; empty when Redis is a single server."""
    group = redis_group(cfg)
    return cfg.redis_sentinels or (group.sentinel_list if group is not None else "")


def redis_client(cfg: StackConfig, timeout_s: float = 5.0) -> redis.Redis:
    """Redis as its default user (operators, the tests), following failovers when the stack has
    Sentinels: the primary they name, asked again after a broken connection."""
    from shared.redis_client import connect

    listed = sentinels(cfg)
    password = sentinel_passwords(cfg.run_dir / "redis-auth")["default"] if listed else ""
    return connect(
        cfg.redis_url,
        sentinels=listed,
        master_name=MASTER_NAME,
        sentinel_user="default",
        sentinel_password=password,
        timeout_s=timeout_s,
    )


def zipkin_server(cfg: StackConfig) -> ZipkinServer:
    return ZipkinServer(cfg.run_dir, port=cfg.zipkin_port)


def prometheus_server(cfg: StackConfig) -> PrometheusServer:
    return PrometheusServer(
        cfg.run_dir,
        cfg.prometheus_port,
        control_url=cfg.control_url,
        alertmanager_port=cfg.alertmanager_port,
        intervals=cfg.prometheus_intervals,
    )


def alertmanager(cfg: StackConfig) -> Alertmanager:
    return Alertmanager(
        cfg.run_dir, cfg.alertmanager_port, control_url=cfg.control_url, grouping=cfg.alert_grouping
    )


def start_monitoring(cfg: StackConfig, step: Callable[[str], None] = print) -> None:
    """Alertmanager and Prometheus, up and answering (reused when already running). Prometheus finds
    its targets through control, so it shows them once control is up."""
    if not cfg.control_token:
        raise InfraError("the monitoring stack needs a control token (StackConfig.control_token)")
    am, prom = alertmanager(cfg), prometheus_server(cfg)
    step(f"Alertmanager: starting on {am.url}")
    am.start()
    step(f"Prometheus: starting on {prom.url}")
    prom.start()
    am.wait_ready()
    prom.wait_ready()


def start_infrastructure(cfg: StackConfig, step: Callable[[str], None] = print) -> None:
    """Redis, the Kafka broker and Zipkin, up and answering (reused when already running)."""
    group = redis_group(cfg)
    if group is not None:
        step(f"Redis: a primary, replicas and Sentinels ({group.sentinel_list})")
        group.up()
    else:
        r = redis_server(cfg)
        step("Redis: checking the redis-server package")
        r.ensure_installed()
        step(f"Redis: starting on 127.0.0.1:{cfg.redis_port}")
        r.start()
        r.wait_ready()
    k = broker(cfg)
    step(f"Kafka: starting a KRaft broker on {cfg.bootstrap}")
    k.start()
    z = zipkin_server(cfg)
    step(f"Zipkin: starting on {cfg.zipkin_url} (tracing UI)")
    z.start()
    k.wait_ready()
    z.wait_ready()


def token_file(path: Path) -> str:
    """A random bearer token kept in ``path`` (0600): made on first use, then read back."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def ingest_token(cfg: StackConfig) -> str:
    """The bearer token for ingest's HTTP endpoint, one per run dir."""
    return token_file(cfg.run_dir / "ingest-token")


# A processor that starts with no job warms up this long before it registers (services/processor/
# warmup/): the first burst it meets then runs on code the JIT has compiled. One given spec files
# starts their jobs at once instead. The time bounds all of the warm-up, the backlog's write included.
PROCESSOR_WARMUP_S = 30


def service_env(cfg: StackConfig) -> dict[str, str]:
    """Everything the services are configured with: one environment, read by their Settings."""
    specs = json.dumps([str(p.resolve()) for p in cfg.job_specs])
    ingest_port, processor_port, sink_port = cfg.metrics_ports
    monitoring = MonitoringAuth(cfg.run_dir)
    return {
        "SF_KAFKA_BOOTSTRAP": cfg.bootstrap,
        "SF_DATA_DIR": str(cfg.data_dir.resolve()),
        "SF_TLS_DIR": str(cfg.pki_dir.resolve()),
        "SF_INGEST_JOB_SPECS": specs,
        "SF_INGEST_HTTP_TOKENS": json.dumps([ingest_token(cfg)]),
        "SF_INGEST_METRICS_PORT": str(ingest_port),
        "SF_PROCESSOR_JOB_SPECS": specs,
        "SF_PROCESSOR_SPARK_JARS": json.dumps([str(p) for p in spark_kafka_jars()]),
        **{f"SF_PROCESSOR_{k.upper()}": v for k, v in processor_jvm_settings().items()},
        "SF_PROCESSOR_SPARK_UI_PORT": str(cfg.spark_ui_port),
        "SF_PROCESSOR_WARMUP_S": str(PROCESSOR_WARMUP_S),
        "SF_PROCESSOR_METRICS_PORT": str(processor_port),
        "SF_SINK_JOB_SPECS": specs,
        "SF_SINK_METRICS_PORT": str(sink_port),
        "SF_CONTROL_PORT": str(cfg.control_port),
        **(
            {
                "SF_CONTROL_TOKENS": json.dumps(
                    {cfg.control_token: ["read", "write"], **monitoring.control_tokens()}
                )
            }
            if cfg.control_token
            else {}
        ),
        "SF_CONTROL_GRPC_PORT": str(cfg.grpc_ports[0]),
        "SF_CONTROL_GRPC_TARGET": cfg.control_grpc_targets,
        "SF_PROCESSOR_GRPC_PORT": str(cfg.grpc_ports[1]),
        "SF_INGEST_GRPC_PORT": str(cfg.grpc_ports[2]),
        "SF_SINK_GRPC_PORT": str(cfg.grpc_ports[3]),
        "SF_INGEST_HTTP_PORT": str(cfg.ingest_http_port),
        "SF_TRACING_EXPORTER": "zipkin",
        "SF_TRACING_ENDPOINT": f"{cfg.zipkin_url}{ZIPKIN_SPANS_PATH}",
        # The dashboard's Prometheus sources until the registry provides them.
        "SF_DASHBOARD_METRICS_URLS": json.dumps(
            {
                "ingest": f"http://127.0.0.1:{ingest_port}/metrics",
                "processor": f"http://127.0.0.1:{processor_port}/metrics",
                "sink": f"http://127.0.0.1:{sink_port}/metrics",
            }
        ),
        # Ingest labels its metrics by raw topic: show them under the job that reads that topic.
        "SF_DASHBOARD_ALIASES": json.dumps({s.source.topic: s.id for s in map(load_job_spec, cfg.job_specs)}),
        "PYTHONUNBUFFERED": "1",
    }


def dashboard_env(cfg: StackConfig) -> dict[str, str]:
    """Control's dashboard reads history from Prometheus' query API, as Prometheus' `control` user."""
    return {
        "SF_DASHBOARD_PROMETHEUS_URL": f"http://127.0.0.1:{cfg.prometheus_port}",
        "SF_DASHBOARD_PROMETHEUS_PASSWORD": MonitoringAuth(cfg.run_dir).password("prometheus", "control"),
    }


def start_service(
    cfg: StackConfig,
    name: str,
    extra_env: dict[str, str] | None = None,
    *,
    process: str = "",
    host: procs.Host = procs.LOOPBACK,
) -> int:
    """Start service ``name`` as a process; ``process`` names its pid file and log when it is one
    of several replicas (``ingest-2``), default the service's name. On a ``host`` of its own its
    servers listen on the host's address."""
    if name not in SERVICES:
        raise InfraError(f"unknown service {name!r}; the services are {', '.join(SERVICES)}")
    bind = {"SF_BIND_HOST": host.address} if host.netns else {}
    env = {
        **service_env(cfg),
        **redis_env(cfg, name),
        **kafka_service_env(cfg, name),
        **bind,
        **(extra_env or {}),
    }
    if name == "control":
        env = {**env, **dashboard_env(cfg), **(extra_env or {})}
    ensure_pki(cfg.pki_dir)  # certificates that are missing or about to expire; the rest stay
    if cfg.job_specs and name != "control":
        provision_spec_files(cfg, SPEC_FILE_PARTITIONS)
    return procs.start_process(
        process or name,
        [sys.executable, "-m", f"services.{name}"],
        cfg.run_dir,
        env=env,
        cwd=ROOT,
        host=host,
    )


def kafka_service_env(cfg: StackConfig, service: str) -> dict[str, str]:
    """How ``service`` reaches Kafka: as its own user, whose ACLs say what it may do."""
    return kafka_env(cfg.kafka_access(service if service in SERVICE_USERS else ADMIN))


# The services' default topic_partitions: what they would have created the topics with.
SPEC_FILE_PARTITIONS = 2


def provision_spec_files(cfg: StackConfig, partitions: int) -> None:
    """The topics and grants of the jobs in spec files, which start without control registering them."""
    for path in cfg.job_specs:
        provision_job(cfg.kafka_access(), load_job_spec(path), partitions)


def redis_env(cfg: StackConfig, service: str) -> dict[str, str]:
    """How ``service`` reaches Redis: as its own user (through the Sentinels when the stack has
    replicas), or with no credentials when it needs none."""
    users = {"control": "control", "sink": "sink"}
    if service not in users:
        return {"SF_REDIS_URL": f"redis://127.0.0.1:{cfg.redis_port}/0"}
    group = redis_group(cfg)
    if group is not None:
        return group.client_env(users[service])
    return {"SF_REDIS_URL": redis_server(cfg).url(users[service])}


STANDBY_PROCESSOR = "processor-standby"
# The standby warms up this long before it registers (services/processor/warmup/), the backlog's
# write included.
STANDBY_WARMUP_S = 40


def standby_env(cfg: StackConfig) -> dict[str, str]:
    """What the standby processor runs with on top of service_env(): its own data dir, name and
    ports, the stack's state root, no spec files, a warm-up before it registers."""
    grpc_port, metrics_port, ui_port = cfg.standby_processor_ports
    return {
        "SF_DATA_DIR": str((cfg.data_dir / STANDBY_PROCESSOR).resolve()),
        "SF_PROCESSOR_STATE_ROOT": cfg.data_dir.resolve().as_uri(),
        "SF_PROCESSOR_NAME": STANDBY_PROCESSOR,
        "SF_PROCESSOR_JOB_SPECS": "[]",
        "SF_PROCESSOR_WARMUP_S": str(STANDBY_WARMUP_S),
        "SF_PROCESSOR_GRPC_PORT": str(grpc_port),
        "SF_PROCESSOR_METRICS_PORT": str(metrics_port),
        "SF_PROCESSOR_SPARK_UI_PORT": str(ui_port),
    }


def start_standby_processor(cfg: StackConfig, *, wait: bool = True) -> int:
    """A second processor beside the stack's own, for fast failover: warm (its JVM and SparkSession
    up, a throwaway job run), it takes over the jobs of a processor that dies as soon as control
    learns of it, where a restarted processor would first have to start Spark. It keeps its own
    job ledger but shares the state root (a takeover renames the job's checkpoint to a new epoch, so
    two copies of a job never write one), and runs only what control places on it; control places
    each new job on the one with more task slots free for it."""
    pid = start_service(cfg, "processor", standby_env(cfg), process=STANDBY_PROCESSOR)
    if wait:
        wait_process_ready(cfg, STANDBY_PROCESSOR, standby_metrics_url(cfg))
    return pid


def standby_metrics_url(cfg: StackConfig) -> str:
    return f"http://127.0.0.1:{cfg.standby_processor_ports[1]}/metrics"


def _port_of(cfg: StackConfig, name: str) -> int:
    return {
        "ingest": cfg.metrics_ports[0],
        "processor": cfg.metrics_ports[1],
        "sink": cfg.metrics_ports[2],
        "control": cfg.control_port,
    }[name]


def wait_service_ready(cfg: StackConfig, name: str, timeout_s: float = 120) -> None:
    """A service is up once its HTTP port answers (control: /readyz says ready)."""
    url = (
        f"{cfg.control_url}/readyz"
        if name == "control"
        else f"http://127.0.0.1:{_port_of(cfg, name)}/metrics"
    )
    wait_process_ready(cfg, name, url, timeout_s)


def wait_process_ready(cfg: StackConfig, process: str, url: str, timeout_s: float = 120) -> None:
    """Block until ``url`` answers 200; InfraError (with the log's tail) if ``process`` exits first."""
    log = procs.log_file(process, cfg.run_dir)

    def ready() -> bool:
        if not procs.is_running(process, cfg.run_dir):
            raise InfraError(f"{process} exited during start-up; see {log}:\n{_tail(log)}")
        return _http_ok(url)

    procs.wait_for(ready, timeout_s, f"{process} to be ready", log_path=log)


def start_services(
    cfg: StackConfig, names: Sequence[str] = SERVICES, step: Callable[[str], None] = print
) -> None:
    for name in names:
        step(f"starting {name}")
        start_service(cfg, name)
    for name in names:
        wait_service_ready(cfg, name)
        step(f"{name} ready (pid {procs.pid_of(name, cfg.run_dir)})")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
