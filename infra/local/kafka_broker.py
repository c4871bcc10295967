"""A single-node Kafka broker in KRaft mode (broker+controller in one JVM), run as a detached process.

Layout under run_dir (``kafka`` is the process name; a cluster's nodes, infra/cluster/, use their own):
  kafka/server.properties   generated config (rewritten on every start; 0600, it holds admin's password)
  kafka/cluster.json        cluster id and controller port the storage was formatted with
  kafka/data/               log.dirs (topics and the __cluster_metadata log)
  logs/kafka.out            JVM stdout/stderr (WARN and up from log4j2, JVM errors)
  logs/kafka/server.log     broker INFO log (log4j2, size-rotated), logs/kafka/gc.log
  pids/kafka.pid
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

from infra.artifacts.fetch import CACHE_DIR, kafka_classpath, require_java
from infra.errors import InfraError
from infra.local import procs
from infra.local.jvm import checked_memory, private_tmpdir
from infra.local.kafka_auth import KafkaAuth
from infra.local.redis_server import write_private
from infra.paths import logs_dir
from shared.jvm import memory_mib
from shared.kafka import KafkaAccess
from shared.kafka_acl import ADMIN

NAME = "kafka"
LOG4J2_CONFIG = Path(__file__).resolve().parent / "kafka-log4j2.properties"

# librdkafka logs every refused connection while we poll a starting broker; keep that out of the console.
LIBRDKAFKA_LOGGER = logging.getLogger("infra.local.kafka_broker.librdkafka")
LIBRDKAFKA_LOGGER.addHandler(logging.NullHandler())
LIBRDKAFKA_LOGGER.propagate = False


def new_cluster_id() -> str:
    """A Kafka-style cluster id: a random UUID, base64url without padding (22 chars)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):  # Kafka's own generator avoids these (they read like CLI flags)
            return cid


def _java_major() -> int:
    out = subprocess.run([require_java(), "-version"], capture_output=True, text=True, check=False).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        raise InfraError(f"cannot tell the Java version from `java -version`:\n{out}")
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


# The broker's heap limit: little of its heap outlives a young collection even under the benches'
# largest bursts, while G1 grows a busy heap towards whatever limit it has, so a larger one only
# costs resident memory.
DEFAULT_HEAP = "384m"


class KafkaBroker:
    """Single-node KRaft broker on 127.0.0.1, or on ``host``. Idempotent: up() reuses our broker if it
    is already healthy. With ``auth`` (by default the run directory's users) every listener takes
    SASL and ACLs decide what a user may do; ``authenticated=False`` opens it to anyone."""

    def __init__(
        self,
        run_dir: Path,
        port: int = 9092,
        controller_port: int = 9093,
        heap: str = DEFAULT_HEAP,
        *,
        cache_dir: Path = CACHE_DIR,
        name: str = NAME,
        host: procs.Host = procs.LOOPBACK,
        authenticated: bool = True,
        auth: KafkaAuth | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.auth = (auth or KafkaAuth(run_dir)) if authenticated else None
        self.port = port
        self.controller_port = controller_port
        self.heap = checked_memory(heap, f"the {name} heap")
        self.cache_dir = cache_dir
        self.name = name  # of its pid file, home and logs
        self.host = host  # its listeners' address, and the namespace it runs in
        self.home = run_dir / name
        self.data_dir = self.home / "data"
        self.config_path = self.home / "server.properties"
        self.state_path = self.home / "cluster.json"
        self.log_path = logs_dir(run_dir) / f"{name}.out"
        self.server_log_dir = logs_dir(run_dir) / name

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host.address}:{self.port}"

    def access(self, user: str = ADMIN) -> KafkaAccess:
        """How ``user`` connects (anyone, on a broker without authentication)."""
        return (
            self.auth.access(self.bootstrap_servers, user)
            if self.auth
            else KafkaAccess(self.bootstrap_servers)
        )

    @property
    def pid(self) -> int | None:
        return procs.pid_of(self.name, self.run_dir)

    def quorum_properties(self) -> dict[str, object]:
        """Who this node is in the KRaft quorum: here the only voter (a dynamic quorum of one)."""
        return {
            "process.roles": "broker,controller",
            "node.id": 1,
            "controller.quorum.bootstrap.servers": f"{self.host.address}:{self.controller_port}",
        }

    def replication_properties(self) -> dict[str, object]:
        """Replication factors and minimum in-sync replicas: one copy of everything on one node."""
        return {
            "default.replication.factor": 1,
            "min.insync.replicas": 1,
            "offsets.topic.replication.factor": 1,
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
        }

    def format_flags(self) -> list[str]:
        """How `kafka-storage format` sets up the quorum: a single-node dynamic quorum (needs
        controller.quorum.bootstrap.servers)."""
        return ["--standalone"]

    def server_properties(self) -> str:
        """The broker config. Sized for a 2-core box; quorum and replication from the methods above."""
        address = self.host.address
        listeners: dict[str, object] = {
            "listeners": f"PLAINTEXT://{address}:{self.port},CONTROLLER://{address}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{address}:{self.port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
        }
        if self.auth is not None:
            listeners = self.auth.broker_properties(
                address, self.port, f"{address}:{self.controller_port}", self.name
            )
        props: dict[str, object] = {
            **self.quorum_properties(),
            **listeners,
            "controller.listener.names": "CONTROLLER",
            "log.dirs": self.data_dir,
            "num.partitions": 2,
            **self.replication_properties(),
            # Tests create topics implicitly; keep auto-creation on.
            "auto.create.topics.enable": "true",
            "delete.topic.enable": "true",
            # Internal topics: fewer partitions than the default 50 so the first consumer group /
            # transaction / share group doesn't spend seconds creating them.
            "offsets.topic.num.partitions": 8,
            "transaction.state.log.num.partitions": 8,
            "share.coordinator.state.topic.num.partitions": 4,
            # Consumers in tests should get their partitions immediately.
            "group.initial.rebalance.delay.ms": 0,
            # Few threads: 2 cores shared with Spark and the services.
            "num.network.threads": 2,
            "num.io.threads": 4,
            "num.recovery.threads.per.data.dir": 1,
            "background.threads": 4,
            # The compaction dedupe buffer defaults to 128 MiB of heap; compacted topics here are tiny.
            "log.cleaner.dedupe.buffer.size": 32 * 1024 * 1024,
            "log.retention.hours": 24,
            "log.segment.bytes": 64 * 1024 * 1024,
        }
        source = type(self).__module__.replace(".", "/")
        lines = [f"# generated by {source}.py; edits are overwritten on start"]
        lines += [f"{k}={v}" for k, v in props.items()]
        return "\n".join(lines) + "\n"

    def jvm_options(self) -> list[str]:
        initial = self.heap if memory_mib(self.heap) < 256 else "256m"
        gc_log = self.server_log_dir / "gc.log"
        return [
            f"-Xms{initial}",
            f"-Xmx{self.heap}",
            # Low-pause G1 with thread counts for a 2-core machine.
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-XX:ParallelGCThreads=2",
            "-XX:ConcGCThreads=1",
            "-XX:CICompilerCount=2",
            "-XX:+ExitOnOutOfMemoryError",
            f"-Xlog:gc*:file={gc_log}:time,tags:filecount=3,filesize=10M",
            "-Djava.awt.headless=true",
            *self._logging_options(),
        ]

    def _logging_options(self) -> list[str]:
        return [f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}", f"-Dkafka.logs.dir={self.server_log_dir}"]

    def _classpath(self) -> str:
        return os.pathsep.join(str(p) for p in kafka_classpath(self.cache_dir))

    def _read_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return state if isinstance(state, dict) else None

    def _formatted_cluster_id(self) -> str | None:
        try:
            text = (self.data_dir / "meta.properties").read_text()
        except FileNotFoundError:
            return None
        match = re.search(r"^cluster\.id=(\S+)$", text, re.MULTILINE)
        return match.group(1) if match else None

    def ensure_formatted(self, classpath: str) -> str:
        """Format log.dirs once (KRaft needs it); later starts reuse the data. Returns the cluster id."""
        state = self._read_state()
        formatted_id = self._formatted_cluster_id()
        if formatted_id is not None:
            if state and state.get("controller_port") not in (None, self.controller_port):
                # --standalone records the controller endpoint in the metadata log; it cannot move.
                raise InfraError(
                    f"Kafka data in {self.data_dir} was formatted for controller port "
                    f"{state['controller_port']}, not {self.controller_port}; use that port or delete "
                    f"{self.home} to start with an empty broker"
                )
            if state is not None and bool(state.get("authenticated")) != (self.auth is not None):
                raise InfraError(
                    f"Kafka data in {self.data_dir} was formatted "
                    f"{'with' if self.auth is None else 'without'} authentication; delete {self.home} "
                    "to start with an empty broker"
                )
            if state is None or state.get("cluster_id") != formatted_id:
                self._write_state(formatted_id)
            return formatted_id

        cluster_id = str(state["cluster_id"]) if state and state.get("cluster_id") else self.new_cluster_id()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            require_java(),
            *self._logging_options(),  # the one-shot tool needs no tuned heap
            "-cp",
            classpath,
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            cluster_id,
            "--config",
            str(self.config_path),
            *self.format_flags(),
            *(self.auth.format_flags() if self.auth else []),
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise InfraError(
                f"formatting Kafka storage in {self.data_dir} failed (exit {proc.returncode}):\n{out}"
            )
        self._write_state(cluster_id)
        return cluster_id

    def new_cluster_id(self) -> str:
        """The id to format empty storage with (a node of a cluster takes the cluster's)."""
        return new_cluster_id()

    def _write_state(self, cluster_id: str) -> None:
        state = {
            "cluster_id": cluster_id,
            "controller_port": self.controller_port,
            "authenticated": self.auth is not None,
        }
        self.state_path.write_text(json.dumps(state, indent=2) + "\n")

    def start(self) -> int:
        """Start the broker (or return the pid of ours if it is already running). Does not wait."""
        pid = self.pid
        if pid is not None:
            return pid
        procs.require_free_ports(
            (self.port, self.controller_port), "broker", self.run_dir, "choose other Kafka ports", self.host
        )
        if _java_major() < 17:
            raise InfraError("Kafka 4 needs Java 17 or newer; install openjdk-17-jdk-headless")
        classpath = self._classpath()
        self.home.mkdir(parents=True, exist_ok=True)
        self.server_log_dir.mkdir(parents=True, exist_ok=True)
        write_private(self.config_path, self.server_properties())
        self.ensure_formatted(classpath)
        argv = [
            require_java(),
            *self.jvm_options(),
            private_tmpdir(self.home / "tmp"),
            "-cp",
            classpath,
            "kafka.Kafka",
            str(self.config_path),
        ]
        return procs.start_process(
            self.name, argv, self.run_dir, log_path=self.log_path, port=self.port, host=self.host
        )

    def _admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {
            **self.access().config(),
            "socket.timeout.ms": 2000,
            "reconnect.backoff.max.ms": 500,
            "logger": LIBRDKAFKA_LOGGER,
        }
        return AdminClient(conf)

    @staticmethod
    def _answers(admin: Any, timeout_s: float) -> bool:
        from confluent_kafka import KafkaException

        try:
            metadata = admin.list_topics(timeout=timeout_s)
        except KafkaException:
            return False
        return bool(metadata.brokers)

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """True if something on our port answers Kafka metadata requests with a live broker."""
        if not procs.listening(self.port, self.host):
            return False
        return self._answers(self._admin(), timeout_s)

    def wait_ready(self, timeout_s: float = 60) -> None:
        """Block until the broker answers metadata; InfraError (with the log tail) on timeout or exit."""
        pid = self.pid
        if pid is None:
            raise InfraError(
                f"Kafka broker is not running; see {self.log_path}, last lines:\n{procs.tail(self.log_path)}"
            )
        admin = self._admin()
        procs.wait_for(
            lambda: procs.listening(self.port, self.host) and self._answers(admin, 2.0),
            timeout_s,
            f"Kafka broker on {self.bootstrap_servers}",
            self.log_path,
            pid=pid,
        )
        self.set_up_access()

    def set_up_access(self) -> None:
        """The topics and grants no job adds, once the broker answers (a cluster's, once all answer)."""
        if self.auth is not None:
            self.auth.set_up(self.bootstrap_servers)

    def up(self, timeout_s: float = 60) -> int:
        """start() + wait_ready(); returns the pid."""
        pid = self.start()
        self.wait_ready(timeout_s)
        return pid

    def stop(self, timeout_s: float = 20) -> bool:
        """SIGTERM (controlled shutdown), SIGKILL after timeout_s. True if it was running."""
        return procs.stop_process(self.name, self.run_dir, timeout_s)
