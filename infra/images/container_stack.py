"""The four services as containers on this machine (host network), against a broker and Redis running
outside: what `podman run` and the local `podman kube play` of k8s/ are given (the play also runs
HDFS's pods, and two processor replicas).

One StackConfig (infra/local/stack.py) says every port and address, as for the process stack; the settings
are the same SF_* variables. What differs from a process: the certificates are copied to a directory per
service owned by the containers' user (uid 10001) and mounted at SF_TLS_DIR, data stays in the
container (or a volume), and the jars are the image's own.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.images import kube
from infra.images.build import TLS_DIR, USER_UID
from infra.images.podman import ULIMITS, podman, run_podman
from infra.local.stack import StackConfig, redis_server
from infra.pki import ensure_pki

# The containers' user (infra/images/containers/python.Containerfile).
UID = USER_UID


def local_settings(cfg: StackConfig) -> dict[str, str]:
    """The non-secret settings of every service on this machine: the StackConfig's ports, 127.0.0.1
    hosts, the local broker (the ConfigMap's keys, with local values)."""
    ingest_metrics, processor_metrics, sink_metrics = cfg.metrics_ports
    control_grpc, processor_grpc, ingest_grpc, sink_grpc = cfg.grpc_ports
    return {
        "SF_KAFKA_BOOTSTRAP": cfg.bootstrap,
        **(
            {
                "SF_KAFKA_SECURITY_PROTOCOL": auth.protocol,
                "SF_KAFKA_SASL_PASSWORD_FILE": f"{TLS_DIR}/{kube.KAFKA_PASSWORD}",
                # The CA beside each service's certificate, if the broker takes TLS (empty: it does not).
                "SF_KAFKA_SSL_CA_FILE": f"{TLS_DIR}/ca.crt" if auth.ca_file else "",
            }
            if (auth := cfg.kafka_auth()) is not None
            else {}
        ),
        "SF_CONTROL_GRPC_TARGET": f"127.0.0.1:{control_grpc}",
        "SF_TRACING_EXPORTER": "none",
        "SF_BIND_HOST": "127.0.0.1",
        "SF_CONTROL_PORT": str(cfg.control_port),
        "SF_CONTROL_GRPC_PORT": str(control_grpc),
        "SF_INGEST_HTTP_PORT": str(cfg.ingest_http_port),
        "SF_INGEST_GRPC_PORT": str(ingest_grpc),
        "SF_INGEST_METRICS_PORT": str(ingest_metrics),
        "SF_PROCESSOR_GRPC_PORT": str(processor_grpc),
        "SF_PROCESSOR_METRICS_PORT": str(processor_metrics),
        "SF_PROCESSOR_SPARK_UI_PORT": "0",
        "SF_SINK_GRPC_PORT": str(sink_grpc),
        "SF_SINK_METRICS_PORT": str(sink_metrics),
        # The driver and its executors on one host network, on loopback.
        "SF_PROCESSOR_SPARK_CONF": json.dumps(
            {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
        ),
    }


def kube_settings(cfg: StackConfig) -> dict[str, str]:
    """local_settings plus what the played manifests add: the HDFS pods on cfg's HDFS ports, one
    DataNode (one replica of each block), the processors' state on that HDFS."""
    settings = local_settings(cfg)
    namenode = f"127.0.0.1:{cfg.hdfs_port}"
    conf = {**json.loads(settings["SF_PROCESSOR_SPARK_CONF"]), "spark.hadoop.dfs.replication": "1"}
    return {
        **settings,
        "SF_PROCESSOR_SPARK_CONF": json.dumps(conf),
        "SF_PROCESSOR_STATE_ROOT": f"hdfs://{namenode}/streamforge",
        "SF_HDFS_NAMENODE_HOST": "127.0.0.1",
        "SF_HDFS_NAMENODE_PORT": str(cfg.hdfs_port),
        "SF_HDFS_NAMENODE_HTTP_PORT": str(cfg.hdfs_port + 1),
        "SF_HDFS_DATANODE_PORT": str(cfg.hdfs_port + 2),
        "SF_HDFS_DATANODE_IPC_PORT": str(cfg.hdfs_port + 3),
        "SF_HDFS_DATANODE_HTTP_PORT": str(cfg.hdfs_port + 4),
        "SF_HDFS_REPLICATION": "1",
    }


def standby_settings(cfg: StackConfig) -> dict[str, str]:
    """The second processor replica's own ports (the replicas share the host network)."""
    grpc_port, metrics_port, _ui = cfg.standby_processor_ports
    return {"SF_PROCESSOR_GRPC_PORT": str(grpc_port), "SF_PROCESSOR_METRICS_PORT": str(metrics_port)}


@dataclass(frozen=True)
class Credentials:
    """What the Secrets carry: tokens and each service's Redis URL (Redis ACL users)."""

    control_token: str
    ingest_token: str
    control_redis_url: str
    sink_redis_url: str
    redis_url: str
    kafka_passwords: Mapping[str, str]  # by service; empty: a broker without authentication

    @classmethod
    def for_stack(cls, cfg: StackConfig, control_token: str, ingest_token: str) -> Credentials:
        r = redis_server(cfg)
        auth = cfg.kafka_auth()
        return cls(
            control_token,
            ingest_token,
            r.url("control"),
            r.url("sink"),
            f"redis://127.0.0.1:{cfg.redis_port}/0",
            {s: auth.passwords()[s] for s in kube.SERVICES} if auth is not None else {},
        )

    def env(self, service: str) -> dict[str, str]:
        """The secret settings of ``service``, as the Deployments take them from the Secret."""
        out = {
            "SF_REDIS_URL": {"control": self.control_redis_url, "sink": self.sink_redis_url}.get(
                service, self.redis_url
            )
        }
        if service == "control":
            out["SF_CONTROL_TOKENS"] = json.dumps({self.control_token: ["read", "write"]})
        if service == "ingest":
            out["SF_INGEST_HTTP_TOKENS"] = json.dumps([self.ingest_token])
        if self.kafka_passwords:
            out["SF_KAFKA_SASL_USERNAME"] = service
        return out

    def secret_docs(self, pki_dir: Path) -> list[kube.Doc]:
        return kube.secrets(
            pki_dir,
            control_tokens={self.control_token: ["read", "write"]},
            ingest_tokens=[self.ingest_token],
            control_redis_url=self.control_redis_url,
            sink_redis_url=self.sink_redis_url,
            redis_url=self.redis_url,
            kafka_passwords=self.kafka_passwords or dict.fromkeys(kube.SERVICES, ""),
        )


def tls_dirs(pki_dir: Path, out_dir: Path, kafka_passwords: Mapping[str, str]) -> dict[str, Path]:
    """One directory per service with the CA certificate and only that service's certificate and key
    (and its Kafka password), readable by the containers' user alone (what the Secret volume of its
    Deployment holds)."""
    ensure_pki(pki_dir)
    dirs = {}
    for service in kube.SERVICES:
        d = out_dir / service
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for name in ("ca.crt", f"{service}.crt", f"{service}.key"):
            shutil.copy2(pki_dir / name, d / name)
        if service in kafka_passwords:
            (d / kube.KAFKA_PASSWORD).write_text(kafka_passwords[service] + "\n")
        for path in d.iterdir():
            path.chmod(0o400)
            os.chown(path, UID, UID)
        os.chown(d, UID, UID)
        d.chmod(0o500)
        dirs[service] = d
    return dirs


def container_name(cfg: StackConfig, service: str) -> str:
    """Names carry the control port, so test runs with different port offsets never collide."""
    return f"streamforge-{service}-{cfg.control_port}"


def run_service(
    cfg: StackConfig,
    service: str,
    image: str,
    credentials: Credentials,
    tls_dir: Path,
    extra_env: Mapping[str, str] | None = None,
) -> str:
    """``podman run -d`` of ``image`` on the host network; returns the container's name."""
    name = container_name(cfg, service)
    remove(name)
    env = {**local_settings(cfg), **credentials.env(service), **(extra_env or {})}
    args = [
        "run",
        "--detach",
        "--name",
        name,
        "--network",
        "host",
        *ULIMITS,
        "--volume",
        f"{tls_dir}:{TLS_DIR}:ro",
        *(a for k, v in sorted(env.items()) for a in ("--env", f"{k}={v}")),
        image,
    ]
    podman(args)
    return name


def remove(name: str) -> None:
    """Stop (SIGTERM, then SIGKILL after 30 s) and remove the container ``name``, if it exists."""
    run_podman(["rm", "--force", "--time", "30", name])


def is_running(name: str) -> bool:
    out = run_podman(["container", "inspect", "--format", "{{.State.Running}}", name])
    return out.stdout.strip() == "true"


def logs(name: str, lines: int = 30) -> str:
    out = run_podman(["logs", "--tail", str(lines), name])
    return f"--- {name}\n{out.stdout}{out.stderr}"


def healthy(name: str) -> bool:
    """podman's healthcheck (kube play makes one of a livenessProbe) passes now."""
    return run_podman(["healthcheck", "run", name]).returncode == 0


# --- podman kube play of k8s/ ----------------------------------------------------------------------


@dataclass(frozen=True)
class KubePlay:
    """The manifests of k8s/ played by podman on this machine, named with ``suffix`` (so that
    runs on other port offsets play beside it): the YAML file played and the podman secrets made."""

    manifest: Path
    secrets: tuple[str, ...]
    volumes: tuple[str, ...]
    pods: dict[str, str]  # workload (a StatefulSet's: its pod, processor-0) -> pod name

    def containers(self) -> dict[str, str]:
        """The container of each pod, by workload."""
        found = {}
        for service, pod in self.pods.items():
            out = podman(["ps", "--all", "--filter", f"pod={pod}", "--format", "{{.Names}} {{.IsInfra}}"])
            names = [line.split()[0] for line in out.splitlines() if line.split()[1:] == ["false"]]
            if len(names) != 1:
                raise InfraError(f"expected one container in pod {pod}, found {names}")
            found[service] = names[0]
        return found

    def down(self) -> None:
        """Stop and remove the pods, then the secrets and volumes this play made."""
        run_podman(["kube", "down", str(self.manifest)])
        for secret in self.secrets:
            run_podman(["secret", "rm", secret])
        # podman 4.3 also leaves a volume named after each Secret a pod mounted.
        for volume in (*self.volumes, *self.secrets):
            run_podman(["volume", "rm", "--force", volume])


def _rename(docs: list[kube.Doc], suffix: str) -> None:
    """Every object and every reference to one gets ``suffix`` (Deployments, ConfigMap, Secrets, claims)."""
    for d in docs:
        d["metadata"]["name"] += suffix
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        for vol in pod.get("volumes", []):
            if "secret" in vol:
                vol["secret"]["secretName"] += suffix
            if "persistentVolumeClaim" in vol:
                vol["persistentVolumeClaim"]["claimName"] += suffix
        for c in pod["containers"]:
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    src["configMapRef"]["name"] += suffix
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    ref["name"] += suffix


def kube_play(
    cfg: StackConfig,
    credentials: Credentials,
    pki_dir: Path,
    work_dir: Path,
    image_refs: Mapping[str, str],
) -> KubePlay:
    """``podman kube play`` of k8s/ on the host network, with ``cfg``'s ports and addresses, the
    Secrets made from ``pki_dir`` and ``credentials`` and the images ``image_refs`` (image name ->
    ref): every workload, with two processor replicas and one of everything else."""
    suffix = f"-{cfg.control_port}"
    docs = kube.load()
    local = kube.local_manifests(docs, kube_settings(cfg), {"processor": [{}, standby_settings(cfg)]})
    for d in local:
        if d["kind"] == "Deployment":
            for c in kube.containers(d):
                # localhost/streamforge/<image>:<version> -> the ref built from this checkout
                c["image"] = image_refs[c["image"].rsplit("/", 1)[1].split(":")[0]]
    deployments = [d["metadata"]["name"] for d in local if d["kind"] == "Deployment"]
    secret_docs = credentials.secret_docs(pki_dir)
    for d in secret_docs:
        d["metadata"]["name"] += suffix
    _rename(local, suffix)
    manifest = work_dir / "streamforge-kube.yaml"
    manifest.write_text(kube.dump(local))
    secrets = kube.podman_secrets(local, secret_docs)
    play = KubePlay(
        manifest,
        tuple(secrets),
        tuple(d["metadata"]["name"] for d in local if d["kind"] == "PersistentVolumeClaim"),
        {d: f"{d}{suffix}-pod-0" for d in deployments},  # podman 4.3 names a Deployment's pod <name>-pod-0
    )
    play.down()  # whatever an earlier run on these ports left behind
    for name, content in secrets.items():
        path = work_dir / f"secret-{name}"
        path.write_bytes(content)
        path.chmod(0o600)
        try:
            podman(["secret", "create", name, str(path)])
        finally:
            path.unlink()
    try:
        podman(["kube", "play", str(manifest)])
    except InfraError:
        play.down()
        raise
    return play
