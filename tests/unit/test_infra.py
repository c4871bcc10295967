"""Unit tests for infra/: no network, no Kafka/Redis/Maven (those are replaced by fakes)."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from infra.__main__ import main as cli_main
from infra.artifacts import fetch
from infra.cluster import topology as cluster
from infra.cluster.spark_standalone import SparkMaster, SparkWorker
from infra.cluster.topology import ClusterConfig
from infra.errors import InfraError
from infra.local import procs
from infra.local.kafka_auth import KafkaAuth
from infra.local.kafka_broker import KafkaBroker, new_cluster_id
from infra.local.redis_server import RedisServer
from infra.local.stack import STANDBY_PROCESSOR, StackConfig, service_env, standby_env
from infra.local.zipkin import ZipkinServer
from services.processor.settings import ProcessorSettings

# ---------------------------------------------------------------------------------------------- fetch


@pytest.mark.parametrize(
    ("jar", "artifact"),
    [
        ("commons-pool2-2.13.1.jar", "commons-pool2"),
        ("hadoop-client-runtime-3.5.0.jar", "hadoop-client-runtime"),
        ("slf4j-api-1.7.36.jar", "slf4j-api"),
        ("scala-library-2.13.18.jar", "scala-library"),
        ("zstd-jni-1.5.7-7.jar", "zstd-jni"),
        ("spark-sql-kafka-0-10_2.13-4.2.0.jar", "spark-sql-kafka-0-10_2.13"),
        ("kafka_2.13-4.3.1.jar", "kafka_2.13"),
        ("jackson-annotations-2.21.jar", "jackson-annotations"),
        ("javax.inject-1.jar", "javax.inject"),
        ("noversion.jar", "noversion"),
    ],
)
def test_artifact_name(jar: str, artifact: str) -> None:
    assert fetch.artifact_name(jar) == artifact


def _touch_jars(directory: Path, names: list[str]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / n for n in names]
    for p in paths:
        p.write_bytes(b"PK")
    return paths


def test_exclude_shipped_drops_artifacts_pyspark_already_has(tmp_path: Path) -> None:
    shipped = tmp_path / "pyspark-jars"
    _touch_jars(shipped, ["scala-library-2.13.18.jar", "slf4j-api-2.0.17.jar", "commons-pool-1.5.4.jar"])
    ours = _touch_jars(
        tmp_path / "ours",
        [
            "commons-pool2-2.13.1.jar",  # different artifact from commons-pool: kept
            "kafka-clients-3.9.2.jar",
            "scala-library-2.13.15.jar",  # other version of a shipped artifact: dropped
            "slf4j-api-1.7.36.jar",
            "spark-sql-kafka-0-10_2.13-4.2.0.jar",
        ],
    )
    kept = [p.name for p in fetch.exclude_shipped(ours, shipped)]
    assert kept == [
        "commons-pool2-2.13.1.jar",
        "kafka-clients-3.9.2.jar",
        "spark-sql-kafka-0-10_2.13-4.2.0.jar",
    ]


class FakeMaven:
    """Stands in for fetch._run_maven: records calls, 'copies' jars or fails per token-provider version."""

    def __init__(self, missing_token_versions: tuple[str, ...] = ()) -> None:
        self.calls: list[dict[str, str]] = []
        self.missing = missing_token_versions

    def __call__(self, pom: Path, out_dir: Path, props: dict[str, str], cache_dir: Path) -> tuple[int, str]:
        self.calls.append(dict(props))
        token = props.get("spark.token.provider.version")
        if token in self.missing:
            artifact = f"org.apache.spark:spark-token-provider-kafka-0-10_2.13:jar:{token}"
            return 1, f"[ERROR] Could not find artifact {artifact}"
        version = props.get("kafka.version") or props["spark.version"]
        _touch_jars(out_dir, [f"thing-{version}.jar", "slf4j-api-1.7.36.jar"])
        return 0, ""


def test_fetch_uses_stamp_and_refetches_on_version_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeMaven()
    monkeypatch.setattr(fetch, "_run_maven", fake)
    first = fetch.fetch_kafka(tmp_path, kafka_version="4.3.1", log=lambda _m: None)
    assert first.fetched and [c["kafka.version"] for c in fake.calls] == ["4.3.1"]
    stamp = json.loads((fetch.jars_dir("kafka", tmp_path) / fetch.STAMP_NAME).read_text())
    assert stamp["requested"] == {"kafka.version": "4.3.1"}

    again = fetch.fetch_kafka(tmp_path, kafka_version="4.3.1", log=lambda _m: None)
    assert not again.fetched and len(fake.calls) == 1  # maven not run
    assert again.jars == first.jars

    changed = fetch.fetch_kafka(tmp_path, kafka_version="4.2.0", log=lambda _m: None)
    assert changed.fetched and len(fake.calls) == 2
    assert [j.name for j in changed.jars] == ["slf4j-api-1.7.36.jar", "thing-4.2.0.jar"]  # old jar gone


def test_fetch_refetches_when_a_jar_disappears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMaven()
    monkeypatch.setattr(fetch, "_run_maven", fake)
    res = fetch.fetch_kafka(tmp_path, kafka_version="4.3.1", log=lambda _m: None)
    res.jars[0].unlink()
    assert fetch.fetch_kafka(tmp_path, kafka_version="4.3.1", log=lambda _m: None).fetched
    assert len(fake.calls) == 2


def test_spark_kafka_falls_back_to_an_older_token_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeMaven(missing_token_versions=("4.9.9",))
    monkeypatch.setattr(fetch, "_run_maven", fake)
    messages: list[str] = []
    res = fetch.fetch_spark_kafka(tmp_path, spark_version="4.9.9", log=messages.append)
    assert [c["spark.token.provider.version"] for c in fake.calls] == [
        "4.9.9",
        fetch.TOKEN_PROVIDER_FALLBACKS[0],
    ]
    assert res.versions["spark.token.provider.version"] == fetch.TOKEN_PROVIDER_FALLBACKS[0]
    assert any("warning" in m for m in messages)


def test_spark_avro_is_resolved_at_the_connectors_version_without_what_pyspark_ships(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeMaven()
    monkeypatch.setattr(fetch, "_run_maven", fake)
    shipped = tmp_path / "pyspark-jars"
    _touch_jars(shipped, ["slf4j-api-2.0.17.jar"])
    monkeypatch.setattr(fetch, "pyspark_jars_dir", lambda: shipped)
    jars = fetch.spark_avro_jars(tmp_path, log=lambda _m: None)
    assert fake.calls == [{"spark.version": fetch.SPARK_KAFKA_VERSION}]
    assert [j.name for j in jars] == [f"thing-{fetch.SPARK_KAFKA_VERSION}.jar"]  # slf4j-api: pyspark's
    assert fetch.jars_dir("spark-avro", tmp_path) in jars[0].parents


def test_spark_kafka_of_another_major_version_than_pyspark_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InfraError, match="major versions differ"):
        fetch.fetch_spark_kafka(tmp_path, spark_version="3.5.1")


def test_maven_failure_is_an_infra_error_with_the_output_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fetch, "_run_maven", lambda *a: (1, "[ERROR] boom: artifact x not found -> [Help 1]"))
    with pytest.raises(InfraError, match="boom: artifact x not found"):
        fetch.fetch_kafka(tmp_path, log=lambda _m: None)
    assert not (fetch.jars_dir("kafka", tmp_path) / fetch.STAMP_NAME).exists()


def test_missing_mvn_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(InfraError, match="`mvn` not found"):
        fetch.require_mvn()


# ---------------------------------------------------------------------------------------------- kafka


def _props(text: str) -> dict[str, str]:
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return dict(ln.split("=", 1) for ln in lines)


def test_server_properties_single_node_kraft(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path, port=19092, controller_port=19093)
    props = _props(broker.server_properties())
    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["listeners"] == "CLIENT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "CLIENT://127.0.0.1:19092"
    assert props["listener.security.protocol.map"] == "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["sasl.mechanism.controller.protocol"] == "PLAIN"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin"
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:19093"
    assert not [k for k in props if k.startswith("ssl.")]  # one machine's loopback: no TLS
    assert "controller.quorum.voters" not in props  # incompatible with `format --standalone`
    assert props["log.dirs"] == str(tmp_path / "kafka" / "data")
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
    ):
        assert props[key] == "1", key
    assert props["num.partitions"] == "2"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["auto.create.topics.enable"] == "true"
    assert broker.bootstrap_servers == "127.0.0.1:19092"
    open_props = _props(KafkaBroker(tmp_path, authenticated=False).server_properties())
    assert open_props["listeners"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert "authorizer.class.name" not in open_props


def test_the_cluster_takes_sasl_over_tls_on_every_listener(tmp_path: Path) -> None:
    cfg = ClusterConfig(run_dir=tmp_path)
    k = cluster.kafka(cfg)
    for node in k.nodes:
        props = _props(node.server_properties())
        assert props["listener.security.protocol.map"] == "CLIENT:SASL_SSL,CONTROLLER:SASL_SSL"
        assert props["ssl.keystore.location"] == str(tmp_path / "pki" / f"{node.name}.pem")
        assert props["ssl.truststore.location"] == str(cfg.kafka_ca_file)
    assert (tmp_path / "pki" / "ca.key").exists()  # the CA is made when the first node needs it
    for access in (cfg.kafka, k.access("ingest"), cluster.stack_config(cfg).kafka_access("sink")):
        assert access.protocol == "SASL_SSL"
        assert access.ca_file == str(cfg.kafka_ca_file)


def test_kafka_users_are_kept_private_per_run_dir(tmp_path: Path) -> None:
    auth = KafkaAuth(tmp_path)
    password_file = auth.password_file("ingest")
    assert password_file.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "kafka-auth" / "users.json").stat().st_mode & 0o777 == 0o600
    assert KafkaAuth(tmp_path).passwords() == auth.passwords()  # kept, not regenerated
    access = auth.access("127.0.0.1:1", "ingest")
    assert access.config()["sasl.password"] == password_file.read_text().strip()
    assert auth.passwords()["ingest"] not in repr(access) + str(access)
    flags = auth.format_flags()
    assert flags.count("--add-scram") == len(auth.passwords())


def test_jvm_options(tmp_path: Path) -> None:
    opts = KafkaBroker(tmp_path, heap="768m").jvm_options()
    assert "-Xmx768m" in opts and "-Xms256m" in opts and "-XX:+UseG1GC" in opts
    assert any(o.startswith("-Dlog4j2.configurationFile=") and o.endswith("log4j2.properties") for o in opts)
    assert "-Xms128m" in KafkaBroker(tmp_path, heap="128m").jvm_options()
    assert "-Xmx1g" in KafkaBroker(tmp_path, heap=" 1g ").jvm_options()


@pytest.mark.parametrize("size", ["lots", "512", "", "1.5g", "-1g"])
def test_a_jvm_memory_size_without_a_unit_is_refused_before_a_jvm_starts(tmp_path: Path, size: str) -> None:
    """The JVM reads "512" as bytes (and would not start, into a log); each JVM's constructor refuses it."""
    master = SparkMaster(tmp_path, 17077, 18080)
    starts = {
        "the kafka heap": lambda: KafkaBroker(tmp_path, heap=size),
        "the zipkin heap": lambda: ZipkinServer(tmp_path, heap=size),
        "spark-worker-0's executors": lambda: SparkWorker(tmp_path, 0, master, 17078, 18081, memory=size),
    }
    for what, start in starts.items():
        with pytest.raises(InfraError, match=f"bad memory size for {what}: .* with a unit, such as 768m"):
            start()


def test_cluster_id_format() -> None:
    ids = {new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    for cid in ids:
        assert len(cid) == 22 and not cid.startswith("-")
        assert set(cid) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_formatted_storage_is_reused_and_port_change_refused(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path, controller_port=19093)
    broker.data_dir.mkdir(parents=True)
    (broker.data_dir / "meta.properties").write_text(
        "version=1\ncluster.id=AbCdEfGhIjKlMnOpQrStUv\nnode.id=1\n"
    )
    # Already formatted: no StorageTool run (classpath unused), id recorded.
    assert broker.ensure_formatted(classpath="/nonexistent") == "AbCdEfGhIjKlMnOpQrStUv"
    assert json.loads(broker.state_path.read_text())["controller_port"] == 19093
    with pytest.raises(InfraError, match="formatted for controller port 19093"):
        KafkaBroker(tmp_path, controller_port=29093).ensure_formatted(classpath="/nonexistent")


# ---------------------------------------------------------------------------------------------- redis


def test_redis_argv(tmp_path: Path) -> None:
    argv = RedisServer(tmp_path, port=16379).argv("/usr/bin/redis-server")
    assert argv[1] == str(tmp_path / "redis" / "redis.conf")  # the role, as Redis last rewrote it
    pairs = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert pairs["--port"] == "16379"
    assert pairs["--bind"] == "127.0.0.1"
    assert pairs["--daemonize"] == "no"
    assert pairs["--appendonly"] == "yes"
    assert pairs["--save"] == ""
    assert pairs["--dir"] == str(tmp_path / "redis")
    assert pairs["--aclfile"] == str(tmp_path / "redis-auth" / "users.acl")
    assert pairs["--logfile"] == str(tmp_path / "logs" / "redis.log")


def test_redis_users_get_generated_passwords_that_are_kept(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, port=16379)
    first = server.passwords()
    assert set(first) == {"default", "control", "sink", "replication", "sentinel"}
    assert len(set(first.values())) == 5
    assert RedisServer(tmp_path, port=16379).passwords() == first
    assert server.url("sink") == f"redis://sink:{first['sink']}@127.0.0.1:16379/0"
    assert (tmp_path / "redis-auth" / "users.json").stat().st_mode & 0o077 == 0


# ---------------------------------------------------------------------------------------------- procs


def test_process_lifecycle_with_pid_file(tmp_path: Path) -> None:
    before = time.time()
    pid = procs.start_process("sleeper", ["sleep", "30"], tmp_path, port=12345)
    try:
        started = procs.started_at("sleeper", tmp_path)
        # /proc gives the start in clock ticks after a boot time in whole seconds: within a second.
        assert started is not None and before - 1 <= started <= time.time() + 1
        assert procs.pid_of("sleeper", tmp_path) == pid
        assert procs.is_running("sleeper", tmp_path)
        assert procs.pid_file("sleeper", tmp_path).read_text().strip() == str(pid)
        assert procs.recorded_port("sleeper", tmp_path) == 12345
        assert procs.known_names(tmp_path) == ["sleeper"]
        assert procs.rss_mb(pid) > 0
        with pytest.raises(InfraError, match="already running"):
            procs.start_process("sleeper", ["sleep", "30"], tmp_path)
    finally:
        assert procs.stop_process("sleeper", tmp_path, timeout_s=5)
    assert not procs.is_running("sleeper", tmp_path)
    assert procs.started_at("sleeper", tmp_path) is None
    assert not procs.pid_file("sleeper", tmp_path).exists()
    assert not procs.stop_process("sleeper", tmp_path)  # nothing left to stop
    assert procs.rss_mb(pid) == 0.0


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    procs.start_process("stubborn", [sys.executable, "-c", code], tmp_path)
    procs.wait_for(lambda: "up" in procs.log_file("stubborn", tmp_path).read_text(), 10, "stubborn")
    assert procs.stop_process("stubborn", tmp_path, timeout_s=0.5)
    assert not procs.is_running("stubborn", tmp_path)


def test_stale_pid_file_is_not_running(tmp_path: Path) -> None:
    procs.pid_file("ghost", tmp_path).parent.mkdir(parents=True)
    procs.pid_file("ghost", tmp_path).write_text("999999999\n")  # above pid_max: never a live process
    assert procs.pid_of("ghost", tmp_path) is None
    assert procs.stop_all(tmp_path) == []
    assert not procs.pid_file("ghost", tmp_path).exists()


def test_stop_all_stops_services_before_redis_and_kafka(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    procs.pids_dir(tmp_path).mkdir(parents=True)
    for name in ("kafka", "redis", "ingest", "processor"):
        procs.pid_file(name, tmp_path).write_text("1\n")
    order: list[str] = []

    def fake_stop(name: str, run_dir: Path, timeout_s: float = 20) -> bool:
        order.append(name)
        return True

    monkeypatch.setattr(procs, "stop_process", fake_stop)
    assert procs.stop_all(tmp_path) == ["ingest", "processor", "redis", "kafka"]
    assert order == ["ingest", "processor", "redis", "kafka"]


def test_stop_all_stops_the_cluster_services_then_spark_then_kafka_nodes_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["kafka-1", "kafka-2", "kafka-3", "redis", "spark-master", "spark-worker-1", "spark-worker-2"]
    names += ["control", "ingest-1", "processor-2", "sink-1"]
    procs.pids_dir(tmp_path).mkdir(parents=True)
    for name in names:
        procs.pid_file(name, tmp_path).write_text("1\n")
    order: list[str] = []
    signalled: list[int] = []

    def fake_stop(name: str, run_dir: Path, timeout_s: float = 20) -> bool:
        order.append(name)
        return True

    monkeypatch.setattr(procs, "stop_process", fake_stop)
    monkeypatch.setattr(procs, "_signal_group", lambda pid, sig: signalled.append(pid))
    stopped = procs.stop_all(tmp_path)
    assert stopped == order
    assert order == [
        *("control", "ingest-1", "processor-2", "sink-1"),
        *("spark-worker-1", "spark-worker-2", "spark-master", "redis", "kafka-1", "kafka-2", "kafka-3"),
    ]
    # The two workers and the three Kafka nodes got their SIGTERM together, before any was waited for.
    assert len(signalled) == 5
    assert [procs.infra_group(n) for n in ("kafka", "kafka-12", "kafka-x", "spark-workers", "ingest-1")] == [
        "kafka",
        "kafka",
        None,
        None,
        None,
    ]


def test_port_in_use() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert procs.port_in_use(port)
    assert not procs.port_in_use(port)


def test_wait_for_reports_log_tail_on_timeout(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    log.write_text("starting\nsomething went wrong\n")
    with pytest.raises(InfraError, match=r"(?s)svc not ready within 0.3 s.*something went wrong"):
        procs.wait_for(lambda: False, 0.3, "svc", log, interval_s=0.05)


def test_wait_for_propagates_infra_error_and_notices_exit(tmp_path: Path) -> None:
    def fatal() -> bool:
        raise InfraError("gave up")

    with pytest.raises(InfraError, match="gave up"):
        procs.wait_for(fatal, 5, "svc")
    pid = procs.start_process("quick", ["true"], tmp_path)
    with pytest.raises(InfraError, match=f"process {pid} exited"):
        procs.wait_for(lambda: False, 10, "quick", procs.log_file("quick", tmp_path), pid=pid)


# ------------------------------------------------------------------------------------------------ cli


def test_cli_reports_infra_error_without_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: object) -> None:
        raise InfraError("port 9092 is already in use [by something]")

    monkeypatch.setitem(sys.modules["infra.__main__"].COMMANDS, "down", broken)
    assert cli_main(["--run-dir", str(tmp_path), "down"]) == 1
    err = capsys.readouterr().err
    assert "port 9092 is already in use [by something]" in err
    assert "Traceback" not in err


def test_cli_status_with_nothing_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--run-dir", str(tmp_path), "status"]) == 0
    out = capsys.readouterr().out
    assert "kafka" in out and "redis" in out


def test_cli_status_shows_the_run_dirs_below_with_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = tmp_path / "demo"
    pid = procs.start_process("ingest", ["sleep", "30"], demo, port=12346)
    try:
        assert cli_main(["--run-dir", str(tmp_path), "status"]) == 0
        out = capsys.readouterr().out
        assert f"infra status ({demo})" in out
        assert "ingest" in out and str(pid) in out
    finally:
        procs.stop_process("ingest", demo, timeout_s=5)


def test_the_standby_processor_shares_the_state_root_but_nothing_else(tmp_path: Path) -> None:
    cfg = StackConfig(run_dir=tmp_path / "stack")
    primary, standby = service_env(cfg), {**service_env(cfg), **standby_env(cfg)}
    data = Path(primary["SF_DATA_DIR"])
    # The primary's state root is the default, its data dir: the standby's explicit one must be it.
    main_settings = ProcessorSettings(data_dir=primary["SF_DATA_DIR"])
    standby_settings = ProcessorSettings(
        data_dir=standby["SF_DATA_DIR"],
        state_root=standby["SF_PROCESSOR_STATE_ROOT"],
        name=standby["SF_PROCESSOR_NAME"],
    )
    assert standby_settings.state_root_uri == main_settings.state_root_uri == data.resolve().as_uri()
    assert standby_settings.ledger_uri != main_settings.ledger_uri  # its own job ledger
    assert Path(standby["SF_DATA_DIR"]) == data / STANDBY_PROCESSOR
    taken = {
        cfg.kafka_port,
        cfg.controller_port,
        cfg.redis_port,
        cfg.control_port,
        cfg.spark_ui_port,
        cfg.ingest_http_port,
        cfg.zipkin_port,
        *cfg.metrics_ports,
        *cfg.grpc_ports,
    }
    ports = {
        int(standby[k])
        for k in ("SF_PROCESSOR_GRPC_PORT", "SF_PROCESSOR_METRICS_PORT", "SF_PROCESSOR_SPARK_UI_PORT")
    }
    assert len(ports) == 3 and not ports & taken
    assert standby["SF_PROCESSOR_JOB_SPECS"] == "[]" and float(standby["SF_PROCESSOR_WARMUP_S"]) > 0


def test_the_stacks_processor_warms_up_before_it_registers(tmp_path: Path) -> None:
    """The single-machine stack's processor, when it starts with no job, runs the warm-up (with its
    backlog) before it registers: its Settings read that from the stack's environment."""
    env = service_env(StackConfig(run_dir=tmp_path / "stack"))
    warmup_s = float(env["SF_PROCESSOR_WARMUP_S"])
    assert warmup_s > 0
    assert ProcessorSettings(warmup_s=warmup_s).tuning.warmup_backlog_events > 0


# ------------------------------------------------------------------------------------------- bytecode


def test_set_up_compiles_the_virtualenv_so_a_service_start_compiles_no_dependency() -> None:
    """uv installs no bytecode and services may run with PYTHONDONTWRITEBYTECODE: the Makefile's
    virtualenv step compiles it. Checked on modules a processor's start imports."""
    import grpc
    import pandas
    import pyspark.testing.utils

    for module in (pandas, pyspark.testing.utils, grpc):
        source = Path(str(module.__file__))
        cached = Path(importlib.util.cache_from_source(str(source)))
        assert cached.is_file(), f"{source} has no bytecode: `make setup` compiles the virtualenv"
        header = cached.read_bytes()[:16]
        stat = source.stat()
        # The header Python checks before it uses a .pyc: magic, flags (0: by timestamp), mtime, size.
        assert header[:4] == importlib.util.MAGIC_NUMBER
        assert int.from_bytes(header[4:8], "little") == 0
        assert int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
        assert int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF
