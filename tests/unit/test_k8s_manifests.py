"""The Kubernetes manifests (infra/images/k8s) against the Kubernetes schemas (kubernetes-validate,
strict) and against the code: probes on endpoints the services serve, ports the settings name,
Secrets that exist. Also the run-time requirements the images install (infra/images/requirements.py).
No network, no podman."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from infra.images import build, kube, requirements
from infra.images.container_stack import local_settings
from infra.local import hdfs
from infra.local.stack import StackConfig
from infra.paths import ROOT
from infra.pki import ensure_pki
from services.control.api.routes import health
from services.ingest.http import create_app
from services.ingest.settings import IngestSettings

DOCS = kube.load()


@pytest.mark.parametrize("path", kube.manifest_files(), ids=lambda p: p.name)
def test_every_manifest_passes_the_kubernetes_schema(path: Path) -> None:
    docs = kube.load([path])
    assert docs, f"{path} holds no manifest"
    assert kube.validate(docs) == []


def test_the_manifests_refer_to_what_exists() -> None:
    assert kube.cross_check(DOCS) == []
    kinds = sorted({d["kind"] for d in DOCS})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "Secret",
        "Service",
        "StatefulSet",
    ]
    scaled = {d["spec"]["scaleTargetRef"]["name"] for d in DOCS if d["kind"] == "HorizontalPodAutoscaler"}
    assert scaled == {"ingest", "sink"}


def test_the_processor_is_an_active_and_a_standby_with_state_on_hdfs() -> None:
    processor = kube.find(DOCS, "StatefulSet", "processor")
    assert processor["spec"]["replicas"] == 2
    pod = processor["spec"]["template"]["spec"]
    assert not [v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v]
    assert "volumeClaimTemplates" not in processor["spec"]
    (container,) = pod["containers"]
    name = next(e for e in container["env"] if e["name"] == "SF_PROCESSOR_NAME")
    assert name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    settings = kube.find(DOCS, "ConfigMap", kube.CONFIGMAP)["data"]
    namenode = kube.find(DOCS, "StatefulSet", "hdfs-namenode")
    host, port = settings["SF_HDFS_NAMENODE_HOST"], settings["SF_HDFS_NAMENODE_PORT"]
    assert settings["SF_PROCESSOR_STATE_ROOT"] == f"hdfs://{host}:{port}/streamforge"
    assert host == namenode["spec"]["serviceName"] == namenode["metadata"]["name"]
    datanodes = kube.find(DOCS, "StatefulSet", "hdfs-datanode")["spec"]["replicas"]
    assert int(settings["SF_HDFS_REPLICATION"]) == datanodes
    spark_conf = next(e for e in container["env"] if e["name"] == "SF_PROCESSOR_SPARK_CONF")["value"]
    assert json.loads(spark_conf)["spark.hadoop.dfs.replication"] == str(datanodes)


def _deployment(docs: list[kube.Doc], name: str) -> kube.Doc:
    return kube.workloads(docs)[name]


def _set_port_type(docs: list[kube.Doc]) -> None:
    kube.containers(_deployment(docs, "sink"))[0]["ports"][0]["containerPort"] = "grpc"


def _misspell_field(docs: list[kube.Doc]) -> None:
    _deployment(docs, "ingest")["spec"]["replica"] = 2


def _drop_selector(docs: list[kube.Doc]) -> None:
    del _deployment(docs, "control")["spec"]["selector"]


SCHEMA_BREAKS: dict[str, Callable[[list[kube.Doc]], None]] = {
    "port of the wrong type": _set_port_type,
    "unknown field": _misspell_field,
    "required field missing": _drop_selector,
}


@pytest.mark.parametrize("name", SCHEMA_BREAKS)
def test_a_broken_manifest_fails_the_schema(name: str) -> None:
    docs = copy.deepcopy(DOCS)
    SCHEMA_BREAKS[name](docs)
    assert kube.validate(docs) != []


def _probe_elsewhere(docs: list[kube.Doc]) -> None:
    kube.containers(_deployment(docs, "processor"))[0]["livenessProbe"]["httpGet"]["port"] = 9999


def _missing_secret_key(docs: list[kube.Doc]) -> None:
    env = kube.containers(_deployment(docs, "sink"))[0]["env"]
    next(e for e in env if e["name"] == "SF_REDIS_URL")["valueFrom"]["secretKeyRef"]["key"] = "nope"


def _other_image(docs: list[kube.Doc]) -> None:
    kube.containers(_deployment(docs, "control"))[0]["image"] = "docker.io/library/python:3.11"


def _no_service(docs: list[kube.Doc]) -> None:
    docs.remove(kube.find(docs, "Service", "ingest"))


def _no_governing_service(docs: list[kube.Doc]) -> None:
    docs.remove(kube.find(docs, "Service", "hdfs-datanode"))


def _mount_of_nothing(docs: list[kube.Doc]) -> None:
    kube.containers(_deployment(docs, "hdfs-namenode"))[0]["volumeMounts"][0]["name"] = "data"


CROSS_BREAKS: dict[str, Callable[[list[kube.Doc]], None]] = {
    "probe on a port the container does not serve": _probe_elsewhere,
    "Secret key that does not exist": _missing_secret_key,
    "image make images does not build": _other_image,
    "Deployment without a Service": _no_service,
    "StatefulSet without its Service": _no_governing_service,
    "volume mount of no volume": _mount_of_nothing,
}


@pytest.mark.parametrize("name", CROSS_BREAKS)
def test_a_broken_reference_fails_the_cross_check(name: str) -> None:
    docs = copy.deepcopy(DOCS)
    CROSS_BREAKS[name](docs)
    assert kube.validate(docs) == []  # valid Kubernetes, wrong for StreamForge
    assert kube.cross_check(docs) != []


def test_probes_ask_endpoints_the_services_serve() -> None:
    gateway = types.SimpleNamespace(settings=IngestSettings())
    served = {
        "ingest": {r.path for r in create_app(gateway).routes},  # type: ignore[arg-type]
        "control": {r.path for r in health.router.routes},
        # The Prometheus server of the processor and the sink (shared/metrics.py).
        "processor": {"/metrics"},
        "sink": {"/metrics"},
    }
    for service in kube.SERVICES:
        (container,) = kube.containers(_deployment(DOCS, service))
        paths = {container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")}
        assert paths <= served[service], service
    assert {"/healthz", "/readyz"} <= served["ingest"] and {"/healthz", "/readyz"} <= served["control"]


def test_the_committed_secrets_are_placeholders() -> None:
    for doc in kube.load([kube.K8S_DIR / "secrets.yaml"]):
        for key, value in doc["stringData"].items():
            # redis-url names no user (ingest and the processor do not use Redis): nothing secret in it.
            secret = key != "redis-url"
            assert "PRIVATE KEY" not in value and ("REPLACE" in value or not secret), key


def test_local_manifests_run_on_the_given_ports_with_real_secrets(tmp_path: Path) -> None:
    ensure_pki(tmp_path)
    secrets = kube.secrets(
        tmp_path,
        control_tokens={"control-token-123": ["read", "write"]},
        ingest_tokens=["ingest-token-1234567"],
        control_redis_url="redis://control:pw@127.0.0.1:1/0",
        sink_redis_url="redis://sink:pw@127.0.0.1:1/0",
        redis_url="redis://127.0.0.1:1/0",
        kafka_passwords={s: f"{s}-kafka-password" for s in kube.SERVICES},
    )
    assert kube.validate(secrets) == []
    tls = next(d for d in secrets if d["metadata"]["name"] == "streamforge-tls-sink")["stringData"]
    # Its own key only, never the CA's; its own Kafka password.
    assert set(tls) == {"ca.crt", "sink.crt", "sink.key", "kafka.password"}
    assert tls["kafka.password"] == "sink-kafka-password"
    settings = {"SF_SINK_METRICS_PORT": "29103", "SF_LOG_LEVEL": "DEBUG", "SF_PROCESSOR_SPARK_CONF": "{}"}
    standby = {"SF_PROCESSOR_GRPC_PORT": "26127", "SF_PROCESSOR_METRICS_PORT": "29104"}
    local = kube.local_manifests(DOCS, settings, {"processor": [{}, standby]})
    assert kube.validate(local) == []
    assert {d["kind"] for d in local} == {"ConfigMap", "PersistentVolumeClaim", "Deployment"}
    assert kube.find(local, "ConfigMap", kube.CONFIGMAP)["data"]["SF_LOG_LEVEL"] == "DEBUG"
    sink = _deployment(local, "sink")
    assert sink["spec"]["replicas"] == 1 and sink["spec"]["template"]["spec"]["hostNetwork"] is True
    (container,) = kube.containers(sink)
    assert container["livenessProbe"]["httpGet"]["port"] == 29103
    assert "ports" not in container  # the host network maps nothing
    # A StatefulSet's replicas: a Deployment each, named as the pod, which it is told.
    workloads = kube.workloads(local)
    assert {"processor-0", "processor-1", "hdfs-namenode-0", "hdfs-datanode-0"} <= set(workloads)
    assert not {"processor", "hdfs-datanode-1"} & set(workloads)
    (processor,) = kube.containers(workloads["processor-0"])
    env = {e["name"]: e for e in processor["env"]}
    # The ConfigMap's SPARK_CONF applies.
    assert set(env) == {"SF_REDIS_URL", "SF_PROCESSOR_NAME", "SF_KAFKA_SASL_USERNAME"}
    assert env["SF_KAFKA_SASL_USERNAME"]["value"] == "processor"
    assert env["SF_PROCESSOR_NAME"] == {"name": "SF_PROCESSOR_NAME", "value": "processor-0"}
    # The second replica reads its own ports from a ConfigMap of its own.
    (standby_container,) = kube.containers(workloads["processor-1"])
    standby_env = {e["name"]: e.get("value") for e in standby_container["env"]}
    assert standby_env["SF_PROCESSOR_NAME"] == "processor-1"
    (source,) = standby_container["envFrom"]
    standby_settings = kube.find(local, "ConfigMap", source["configMapRef"]["name"])["data"]
    assert standby_settings["SF_PROCESSOR_METRICS_PORT"] == "29104"
    assert standby_settings["SF_LOG_LEVEL"] == "DEBUG"
    assert standby_container["readinessProbe"]["httpGet"]["port"] == 29104
    assert kube.containers(workloads["processor-0"])[0]["envFrom"] == [
        {"configMapRef": {"name": kube.CONFIGMAP}}
    ]
    datanode = workloads["hdfs-datanode-0"]["spec"]["template"]["spec"]
    claim = next(v for v in datanode["volumes"] if v["name"] == "hdfs-data")["persistentVolumeClaim"]
    assert kube.find(local, "PersistentVolumeClaim", claim["claimName"])
    assert claim["claimName"] == "hdfs-data-hdfs-datanode-0"
    (control,) = kube.containers(workloads["control"])
    # SF_CONTROL_ADVERTISED_HOST is the pod's IP, which podman cannot give: left to its default.
    assert {e["name"] for e in control["env"]} == {
        "SF_CONTROL_TOKENS",
        "SF_REDIS_URL",
        "SF_KAFKA_SASL_USERNAME",
    }

    podman = kube.podman_secrets(DOCS, secrets)
    assert set(podman) == {d["metadata"]["name"] for d in secrets}
    flat = json.loads(podman[kube.CREDENTIALS])  # read by secretKeyRef: JSON of base64 values
    assert base64.b64decode(flat["sink-redis-url"]).decode() == "redis://sink:pw@127.0.0.1:1/0"
    volume = yaml.safe_load(podman["streamforge-tls-sink"])  # read by a secret volume: the bytes as they are
    assert volume["data"]["sink.key"] == (tmp_path / "sink.key").read_text()


def test_images_install_the_services_dependencies_pinned_by_the_lock() -> None:
    lock = (ROOT / "requirements.lock").read_text()
    pins = requirements.parse_lock(lock)
    base, spark = requirements.runtime_requirements(lock)
    names = {p.split("==")[0] for p in base}
    assert {"confluent-kafka", "fastapi", "grpcio", "redis", "pydantic-core", "protobuf"} <= names
    assert not names & {"pytest", "faust-streaming", "aiokafka", "typer", "rich", "grpcio-tools", "mypy"}
    assert {p.split("==")[0] for p in spark} == {"pyspark", "py4j"}
    for pin in base + spark:
        name, version = pin.split("==")
        assert pins[name][0] == version
    assert pins["uvicorn"][1] == {"streamforge"}


def test_the_hdfs_image_entry_point_reads_the_configmap_settings(tmp_path: Path) -> None:
    settings = kube.find(DOCS, "ConfigMap", kube.CONFIGMAP)["data"]
    assert {k for k in settings if k.startswith("SF_HDFS_")} | {"SF_BIND_HOST"} == set(hdfs.ENV_DEFAULTS)
    env = {**settings, "SF_HDFS_DATANODE_PORT": "19866"}
    namenode = hdfs.from_env("namenode", tmp_path, tmp_path / "jars", env)
    datanode = hdfs.from_env("datanode", tmp_path, tmp_path / "jars", env)
    assert isinstance(namenode, hdfs.NameNode) and isinstance(datanode, hdfs.DataNode)
    # Listens on every address of the pod, is reached at its Service's name.
    assert namenode.site()["dfs.namenode.rpc-bind-host"] == "0.0.0.0"
    assert namenode.site()["dfs.namenode.rpc-address"] == "hdfs-namenode:8020"
    assert datanode.namenode == "hdfs://hdfs-namenode:8020"
    assert datanode.site()["dfs.datanode.address"] == "0.0.0.0:19866"
    assert namenode.site()["dfs.replication"] == 2
    (tmp_path / "jars").mkdir()
    (tmp_path / "jars" / "hadoop-hdfs-3.5.0.jar").touch()
    assert namenode.classpath().split(os.pathsep)[1:] == [str(tmp_path / "jars" / "hadoop-hdfs-3.5.0.jar")]


def test_the_hdfs_image_carries_every_module_its_entry_point_imports(tmp_path: Path) -> None:
    for module in build.HDFS_MODULES:
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / module, tmp_path / module)
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import infra.local.hdfs as h; "
        f"assert h.__file__.startswith({str(tmp_path)!r}), h.__file__"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, done.stderr


def test_pods_reach_kafka_over_tls_trusting_the_ca_of_their_secret(tmp_path: Path) -> None:
    settings = kube.find(DOCS, "ConfigMap", kube.CONFIGMAP)["data"]
    assert settings["SF_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert settings["SF_KAFKA_SSL_CA_FILE"] == f"{settings['SF_TLS_DIR']}/ca.crt"
    # On one machine the containers meet the stack's loopback broker, which takes no TLS.
    local = local_settings(StackConfig(run_dir=tmp_path))
    assert local["SF_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT"
    assert local["SF_KAFKA_SSL_CA_FILE"] == ""
    tls = local_settings(StackConfig(run_dir=tmp_path, kafka_ca_file=tmp_path / "pki" / "ca.crt"))
    assert tls["SF_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert tls["SF_KAFKA_SSL_CA_FILE"] == f"{build.TLS_DIR}/ca.crt"
