"""A Kafka KRaft cluster on one machine: three combined broker+controller nodes with a static quorum.

Combined nodes: three JVMs instead of four on a 2-core box, and no single controller whose loss stops
every metadata change. Any one node may die: the two others still form a quorum and hold every
partition (replication factor 3, ``min.insync.replicas`` 2), so producers with ``acks=all`` (ingest's
transactions) go on writing. Each node is an ``infra.local.kafka_broker.KafkaBroker`` with its own
name (``kafka-1``...), ports and data. Layout under run_dir:

    kafka-cluster.json        the cluster id every node is formatted with
    kafka-<n>/                that node's server.properties, data/ (see infra/local/kafka_broker.py)
    logs/kafka-<n>.out, logs/kafka-<n>/server.log
    pids/kafka-<n>.pid
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.artifacts.fetch import CACHE_DIR
from infra.errors import InfraError
from infra.local import procs
from infra.local.kafka_auth import KafkaAuth
from infra.local.kafka_broker import LIBRDKAFKA_LOGGER, KafkaBroker, new_cluster_id
from shared.kafka import KafkaAccess
from shared.kafka_acl import ADMIN

REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2


class KafkaNode(KafkaBroker):
    """One voter and broker of a static three-node quorum (``controller.quorum.voters``)."""

    def __init__(
        self,
        run_dir: Path,
        node_id: int,
        ports: Sequence[tuple[int, int]],
        cluster_id: str,
        heap: str = "448m",
        *,
        cache_dir: Path = CACHE_DIR,
        hosts: Sequence[procs.Host] = (),
        auth: KafkaAuth | None = None,
    ) -> None:
        if not 1 <= node_id <= len(ports):
            raise InfraError(f"node id {node_id} is outside 1..{len(ports)}")
        self.hosts = list(hosts) or [procs.LOOPBACK] * len(ports)
        port, controller_port = ports[node_id - 1]
        host = self.hosts[node_id - 1]
        super().__init__(
            run_dir,
            port,
            controller_port,
            heap,
            cache_dir=cache_dir,
            name=f"kafka-{node_id}",
            host=host,
            authenticated=auth is not None,
            auth=auth,
        )
        self.node_id = node_id
        self.ports = list(ports)
        self.cluster_id = cluster_id

    def quorum_properties(self) -> dict[str, object]:
        pairs = zip(self.ports, self.hosts, strict=True)
        voters = ",".join(f"{i}@{h.address}:{c}" for i, ((_, c), h) in enumerate(pairs, start=1))
        return {
            "process.roles": "broker,controller",
            "node.id": self.node_id,
            "controller.quorum.voters": voters,
        }

    def replication_properties(self) -> dict[str, object]:
        """Every topic, internal ones included, on all three nodes; a write needs two of them."""
        rf, isr = min(REPLICATION_FACTOR, len(self.ports)), min(MIN_INSYNC_REPLICAS, len(self.ports))
        return {
            "default.replication.factor": rf,
            "min.insync.replicas": isr,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
            # A node back from a crash takes back the leadership it had once in sync, so leaders do
            # not all pile up on the nodes that never died (the default, checked every 30 s).
            "auto.leader.rebalance.enable": "true",
            "leader.imbalance.check.interval.seconds": 30,
        }

    def set_up_access(self) -> None:
        pass  # KafkaCluster.wait_ready does, once every node is a broker (topics need all replicas)

    def format_flags(self) -> list[str]:
        return []  # a static quorum: the voters are in the config, nothing to record at format time

    def new_cluster_id(self) -> str:
        return self.cluster_id

    def ensure_formatted(self, classpath: str) -> str:
        formatted = super().ensure_formatted(classpath)
        if formatted != self.cluster_id:
            raise InfraError(
                f"{self.name}'s data in {self.data_dir} belongs to Kafka cluster {formatted}, not to "
                f"{self.cluster_id}; delete {self.run_dir} to start the cluster empty"
            )
        return formatted


class KafkaCluster:
    """The nodes of one cluster: started together, each stoppable and restartable on its own.

    By default every node runs on this machine's loopback with its files under run_dir; ``hosts`` and
    ``node_run_dirs`` place node ``i`` on ``hosts[i-1]`` with its files under ``node_run_dirs[i-1]``
    (run_dir then keeps only the cluster id and the users). ``ca_file`` puts SASL over TLS on every
    listener, each node with a certificate from that CA for its address."""

    def __init__(
        self,
        run_dir: Path,
        ports: Sequence[int],
        controller_ports: Sequence[int],
        heap: str = "448m",
        *,
        cache_dir: Path = CACHE_DIR,
        hosts: Sequence[procs.Host] = (),
        node_run_dirs: Sequence[Path] = (),
        authenticated: bool = True,
        ca_file: Path | None = None,
    ) -> None:
        if len(ports) != len(controller_ports) or len(ports) < 3:
            raise InfraError(
                f"a Kafka cluster needs three or more nodes, each with a broker and a controller port "
                f"(got {len(ports)} broker and {len(controller_ports)} controller ports)"
            )
        places = list(hosts) or [procs.LOOPBACK] * len(ports)
        if len(places) != len(ports) or (node_run_dirs and len(node_run_dirs) != len(ports)):
            raise InfraError(f"a Kafka cluster of {len(ports)} nodes needs a host and a directory per node")
        endpoints = [(h.address, p) for h, p in zip(places, ports, strict=True)]
        endpoints += [(h.address, p) for h, p in zip(places, controller_ports, strict=True)]
        if len(set(endpoints)) != 2 * len(ports):
            raise InfraError(f"Kafka ports must all differ: {list(ports)} and {list(controller_ports)}")
        self.run_dir = run_dir
        pairs = list(zip(ports, controller_ports, strict=True))
        cluster_id = self._cluster_id()
        self._admin_client: Any = None
        dirs = list(node_run_dirs) or [run_dir] * len(ports)
        # One set of users for every node: brokers log in to each other as the same admin.
        # With ``ca_file`` (the project CA's, its key beside it) every listener also takes TLS.
        self.auth = KafkaAuth(run_dir, ca_file) if authenticated else None
        self.nodes = [
            KafkaNode(
                dirs[i - 1], i, pairs, cluster_id, heap, cache_dir=cache_dir, hosts=places, auth=self.auth
            )
            for i in range(1, len(pairs) + 1)
        ]

    def _cluster_id(self) -> str:
        path = self.run_dir / "kafka-cluster.json"
        try:
            return str(json.loads(path.read_text())["cluster_id"])
        except (OSError, ValueError, KeyError, TypeError):
            cluster_id = new_cluster_id()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"cluster_id": cluster_id}) + "\n")
            return cluster_id

    @property
    def bootstrap_servers(self) -> str:
        """Every node: clients find the cluster through whichever answers."""
        return ",".join(n.bootstrap_servers for n in self.nodes)

    def access(self, user: str = ADMIN) -> KafkaAccess:
        """How ``user`` connects to the cluster (anyone, without authentication)."""
        if self.auth is None:
            return KafkaAccess(self.bootstrap_servers)
        return self.auth.access(self.bootstrap_servers, user)

    def node(self, node_id: int) -> KafkaNode:
        return self.nodes[node_id - 1]

    def start(self) -> None:
        for n in self.nodes:
            n.start()

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Every node answers metadata and the cluster lists all of them as brokers."""
        for n in self.nodes:
            n.wait_ready(timeout_s)
        procs.wait_for(
            lambda: len(self.live_brokers()) == len(self.nodes),
            timeout_s,
            f"all {len(self.nodes)} Kafka brokers to join the cluster",
            self.nodes[0].server_log_dir / "server.log",
        )
        if self.auth is not None:
            self.auth.set_up(self.bootstrap_servers)

    def up(self, timeout_s: float = 120) -> None:
        self.start()
        self.wait_ready(timeout_s)

    def stop(self, timeout_s: float = 30) -> list[str]:
        """SIGTERM every node at once (one by one, the last would wait for a quorum that is gone)."""
        running = [n for n in self.nodes if procs.send_signal(n.name, n.run_dir, signal.SIGTERM)]
        for n in self.nodes:
            procs.stop_process(n.name, n.run_dir, timeout_s)
        return [n.name for n in running]

    def _admin(self) -> Any:
        """One admin client for this object's life: AdminClients made and dropped one per call, while
        other threads use Kafka clients, crashed the interpreter here (a segfault when the broker they
        polled had been killed; confluent-kafka-python #1761, #2129)."""
        if self._admin_client is not None:
            return self._admin_client
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {
            **self.access().config(),
            "socket.timeout.ms": 3000,
            "reconnect.backoff.max.ms": 500,
            "logger": LIBRDKAFKA_LOGGER,
        }
        self._admin_client = AdminClient(conf)
        return self._admin_client

    def live_brokers(self, timeout_s: float = 5.0) -> list[int]:
        """Ids of the brokers the cluster's metadata lists (a fenced or dead node drops out)."""
        from confluent_kafka import KafkaException

        try:
            return sorted(self._admin().list_topics(timeout=timeout_s).brokers)
        except KafkaException:
            return []

    def under_replicated(self, timeout_s: float = 5.0) -> list[str]:
        """``topic/partition`` of every partition with fewer in-sync replicas than replicas, internal
        topics included (unanswered metadata counts as everything being unknown: ``["?"]``)."""
        from confluent_kafka import KafkaException

        try:
            metadata = self._admin().list_topics(timeout=timeout_s)
        except KafkaException:
            return ["?"]
        return sorted(
            f"{t.topic}/{p.id}"
            for t in metadata.topics.values()
            for p in t.partitions.values()
            if len(p.isrs) < len(p.replicas) or p.error is not None
        )

    def wait_fully_replicated(self, timeout_s: float = 120) -> float:
        """Block until no partition is under-replicated; returns the seconds it took."""
        started = time.monotonic()
        last: list[str] = []

        def done() -> bool:
            nonlocal last
            last = self.under_replicated()
            return not last

        try:
            procs.wait_for(done, timeout_s, "every Kafka partition to be fully in sync", interval_s=0.5)
        except InfraError as e:
            raise InfraError(f"{e}; still under-replicated: {', '.join(last[:10])}") from e
        return time.monotonic() - started
