"""The Kubernetes manifests of k8s/: loading, checking, real Secrets, and a local variant for podman.

    python -m infra.images.kube check                      schema (kubernetes-validate) and cross-references
    python -m infra.images.kube secrets --pki-dir DIR ...  Secret manifests with real certificates and tokens

``k8s/secrets.yaml`` holds placeholders only; ``secrets()`` makes the real ones from a PKI
directory (infra/pki.py) and the tokens and Redis URLs given. ``local_manifests()`` turns the manifests
into what ``podman kube play`` runs on one machine against a local broker and Redis: the pods on the
host network, every port and address from a StackConfig (so parallel runs do not collide), one replica
of each Deployment, each StatefulSet replica as a Deployment of its own, and only the kinds podman 4.3
creates (it skips Services and HorizontalPodAutoscalers, and knows no StatefulSet).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from infra.errors import InfraError
from infra.images.build import IMAGES, SERVICES, image_name, service_image

K8S_DIR = Path(__file__).resolve().parent / "k8s"
KUBERNETES_VERSION = "1.37.0"
CONFIGMAP = "streamforge-settings"
CREDENTIALS = "streamforge-credentials"
# A service's Kafka password, beside its certificate in its TLS Secret (SF_KAFKA_SASL_PASSWORD_FILE).
KAFKA_PASSWORD = "kafka.password"

Doc = dict[str, Any]

# The ConfigMap's port settings → the ports of the StackConfig (infra/local/stack.py) a local run uses.
PORT_SETTINGS = (
    "SF_CONTROL_PORT",
    "SF_CONTROL_GRPC_PORT",
    "SF_INGEST_HTTP_PORT",
    "SF_INGEST_GRPC_PORT",
    "SF_INGEST_METRICS_PORT",
    "SF_PROCESSOR_GRPC_PORT",
    "SF_PROCESSOR_METRICS_PORT",
    "SF_PROCESSOR_SPARK_UI_PORT",
    "SF_SINK_GRPC_PORT",
    "SF_SINK_METRICS_PORT",
    "SF_HDFS_NAMENODE_PORT",
    "SF_HDFS_NAMENODE_HTTP_PORT",
    "SF_HDFS_DATANODE_PORT",
    "SF_HDFS_DATANODE_IPC_PORT",
    "SF_HDFS_DATANODE_HTTP_PORT",
)
# The workloads of hdfs.yaml, run by the hdfs image.
HDFS_WORKLOADS = ("hdfs-namenode", "hdfs-datanode")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def manifest_files(directory: Path = K8S_DIR) -> list[Path]:
    return sorted(directory.glob("*.yaml"))


def load(paths: Sequence[Path] | None = None) -> list[Doc]:
    docs: list[Doc] = []
    for path in paths if paths is not None else manifest_files():
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def find(docs: Sequence[Doc], kind: str, name: str) -> Doc:
    for d in docs:
        if d.get("kind") == kind and d.get("metadata", {}).get("name") == name:
            return d
    raise InfraError(f"no {kind} {name!r} in the manifests")


def containers(doc: Doc) -> list[Doc]:
    return list(doc["spec"]["template"]["spec"]["containers"])


def workloads(docs: Sequence[Doc]) -> dict[str, Doc]:
    """The Deployments and StatefulSets, by name."""
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") in WORKLOAD_KINDS}


def validate(docs: Sequence[Doc], version: str = KUBERNETES_VERSION) -> list[str]:
    """Every problem kubernetes-validate (strict: unknown fields too) finds in ``docs``."""
    import kubernetes_validate

    problems = []
    for d in docs:
        what = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{what}: {path}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
            problems.append(f"{what}: {e}")
    return problems


def _probes(container: Doc) -> Iterator[tuple[str, Doc]]:
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if kind in container:
            yield kind, container[kind]


def cross_check(docs: Sequence[Doc]) -> list[str]:
    """What the schema cannot see: every service and HDFS daemon has a workload (Deployment or
    StatefulSet) and a Service; probes and container ports are the ConfigMap's ports; referenced
    ConfigMaps, Secrets, keys, claims, volumes and HPA targets exist; images are the ones `make images`
    builds."""
    problems: list[str] = []
    settings = find(docs, "ConfigMap", CONFIGMAP)["data"]
    ports = {int(settings[k]) for k in PORT_SETTINGS if k in settings}
    secrets = {
        d["metadata"]["name"]: set((d.get("stringData") or {}) | (d.get("data") or {}))
        for d in docs
        if d.get("kind") == "Secret"
    }
    claims = {d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"}
    services = {d["metadata"]["name"] for d in docs if d.get("kind") == "Service"}
    found = workloads(docs)
    images = {name: service_image(name) for name in SERVICES} | {
        n: image_name("hdfs") for n in HDFS_WORKLOADS
    }
    for name in images:
        if name not in found:
            problems.append(f"no Deployment or StatefulSet {name}")
        if name not in services:
            problems.append(f"no Service {name!r} in the manifests")
    for name, workload in found.items():
        if workload["kind"] == "StatefulSet" and workload["spec"]["serviceName"] not in services:
            problems.append(f"{name}: serviceName {workload['spec']['serviceName']} is no Service")
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])} | {
            t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])
        }
        for c in pod["containers"]:
            wanted = images.get(name)
            if c["image"] != wanted and (wanted or c["image"] not in map(image_name, IMAGES)):
                problems.append(f"{name}: image {c['image']} is not {wanted or 'one make images builds'}")
            own = {p["containerPort"] for p in c.get("ports", [])}
            if not own <= ports:
                problems.append(f"{name}: containerPorts {sorted(own - ports)} are no port setting")
            for kind, probe in _probes(c):
                port = probe.get("httpGet", {}).get("port")
                if port not in own:
                    problems.append(f"{name}: {kind} port {port} is not one of its containerPorts")
            for src in c.get("envFrom", []):
                ref = src.get("configMapRef", {}).get("name")
                if ref and ref != CONFIGMAP:
                    problems.append(f"{name}: envFrom names ConfigMap {ref}")
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], set()):
                    problems.append(
                        f"{name}: {env['name']} names {ref['name']}/{ref['key']}, which is absent"
                    )
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{name}: volumeMount {mount['name']} names no volume or claim template")
        for vol in pod.get("volumes", []):
            if "secret" in vol and vol["secret"]["secretName"] not in secrets:
                problems.append(f"{name}: volume {vol['name']} names a missing Secret")
            if "persistentVolumeClaim" in vol and vol["persistentVolumeClaim"]["claimName"] not in claims:
                problems.append(f"{name}: volume {vol['name']} names a missing PersistentVolumeClaim")
    for hpa in (d for d in docs if d.get("kind") == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        if found.get(target["name"], {}).get("kind") != target["kind"]:
            problems.append(
                f"HorizontalPodAutoscaler {hpa['metadata']['name']} scales a missing {target['name']}"
            )
    return problems


# --- real Secrets ---------------------------------------------------------------------------------


def secrets(
    pki_dir: Path,
    *,
    control_tokens: Mapping[str, Sequence[str]],
    ingest_tokens: Sequence[str],
    control_redis_url: str,
    sink_redis_url: str,
    redis_url: str,
    kafka_passwords: Mapping[str, str],
) -> list[Doc]:
    """The Secrets of secrets.yaml with real values: each service's certificate and key (and the CA
    certificate, never its key) from ``pki_dir`` with its Kafka user's password, the tokens, each
    service's Redis URL."""
    docs = []
    ca = (pki_dir / "ca.crt").read_text()
    for service in SERVICES:
        data = {
            "ca.crt": ca,
            f"{service}.crt": (pki_dir / f"{service}.crt").read_text(),
            f"{service}.key": (pki_dir / f"{service}.key").read_text(),
            KAFKA_PASSWORD: kafka_passwords[service],
        }
        docs.append(_secret(f"streamforge-tls-{service}", data))
    credentials = {
        "control-tokens": json.dumps({t: list(s) for t, s in control_tokens.items()}),
        "ingest-http-tokens": json.dumps(list(ingest_tokens)),
        "control-redis-url": control_redis_url,
        "sink-redis-url": sink_redis_url,
        "redis-url": redis_url,
    }
    docs.append(_secret(CREDENTIALS, credentials))
    return docs


def _secret(name: str, data: Mapping[str, str]) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "streamforge"}},
        "type": "Opaque",
        "stringData": dict(data),
    }


# --- one machine, podman kube play ----------------------------------------------------------------

# What podman 4.3's kube play creates from a YAML file; it skips the rest (Services,
# HorizontalPodAutoscalers). Secrets are made with `podman secret create` instead: see podman_secrets.
PODMAN_KINDS = ("ConfigMap", "PersistentVolumeClaim", "Deployment")


def local_manifests(
    docs: Sequence[Doc],
    settings: Mapping[str, str],
    replica_settings: Mapping[str, Sequence[Mapping[str, str]]] | None = None,
) -> list[Doc]:
    """The manifests for ``podman kube play`` on this machine: ``settings`` (ports, addresses,
    127.0.0.1 hosts, ...) merged into the ConfigMap, probes moved to the ConfigMap's new ports, host
    network (so no containerPorts to map), one replica per Deployment.

    A StatefulSet becomes one Deployment per replica, named as its pod (``processor-0``), with its
    claim templates as PersistentVolumeClaims of that name (``hdfs-data-hdfs-datanode-0``), the
    pod's name where the pod reads ``metadata.name`` and ``localhost`` as its host name. It keeps
    one replica, or as many as ``replica_settings[name]`` lists: the settings each replica gets on
    top (its own ports, as the replicas share the host network), in a ConfigMap of its own.

    Secret volumes say ``optional: false`` (podman 4.3 crashes when it is left out). A container's
    own ``env`` entries that ``settings`` names are dropped (a pod's env would win over
    the ConfigMap), and so are ``status.podIP`` references, which podman 4.3 cannot fill, and the
    entries that use them."""
    out: list[Doc] = []
    base = find(docs, "ConfigMap", CONFIGMAP)["data"]

    def moves(new: Mapping[str, str]) -> dict[int, int]:
        return {int(base[k]): int(new[k]) for k in PORT_SETTINGS if k in new and k in base}

    moved = moves(settings)
    for original in docs:
        kind = original.get("kind")
        if kind == "StatefulSet":
            name = original["metadata"]["name"]
            extra = list((replica_settings or {}).get(name, [{}]))
            for i, own in enumerate(extra):
                claims, replica = _statefulset_pod(original, i)
                out.extend(claims)
                if own:
                    out.append(_own_settings(docs, replica, {**settings, **own}))
                _localize(replica, {**settings, **own}, {**moved, **moves(own)})
                out.append(replica)
            continue
        if kind not in PODMAN_KINDS:
            continue
        d = copy.deepcopy(original)
        if kind == "ConfigMap" and d["metadata"]["name"] == CONFIGMAP:
            d["data"] = {**d["data"], **{k: str(v) for k, v in settings.items()}}
        if kind == "Deployment":
            d["spec"]["replicas"] = 1
            _localize(d, settings, moved)
        out.append(d)
    return out


def _statefulset_pod(statefulset: Doc, index: int) -> tuple[list[Doc], Doc]:
    """Replica ``index`` of ``statefulset`` as a Deployment of one pod, and its claims."""
    spec = statefulset["spec"]
    name = f"{statefulset['metadata']['name']}-{index}"
    template = copy.deepcopy(spec["template"])
    pod_label = {"statefulset.kubernetes.io/pod-name": name}
    template["metadata"]["labels"] = {**template["metadata"].get("labels", {}), **pod_label}
    pod = template["spec"]
    pod.pop("affinity", None)  # one machine
    # Kubernetes makes a pod's host name resolve to its address, and the HDFS daemons look theirs up;
    # podman's host network adds no such entry (nor hostAliases), and on it that address is loopback.
    pod["hostname"] = "localhost"
    claims = []
    for claim_template in spec.get("volumeClaimTemplates", []):
        claim = copy.deepcopy(claim_template)
        claim_name = f"{claim['metadata']['name']}-{name}"
        pod.setdefault("volumes", []).append(
            {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}}
        )
        claim["metadata"]["name"] = claim_name
        claims.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim})
    for c in pod["containers"]:
        for e in c.get("env", []):
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                e.pop("valueFrom")
                e["value"] = name
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**copy.deepcopy(statefulset["metadata"]), "name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {**spec["selector"]["matchLabels"], **pod_label}},
            "template": template,
        },
    }
    return claims, deployment


def _own_settings(docs: Sequence[Doc], deployment: Doc, settings: Mapping[str, str]) -> Doc:
    """A copy of the ConfigMap with ``settings`` for ``deployment`` alone, which now reads it: podman
    4.3 lets a ConfigMap's values win over a container's own ``env``."""
    configmap = copy.deepcopy(find(docs, "ConfigMap", CONFIGMAP))
    configmap["metadata"]["name"] = f"{CONFIGMAP}-{deployment['metadata']['name']}"
    configmap["data"] = {**configmap["data"], **{k: str(v) for k, v in settings.items()}}
    for c in containers(deployment):
        for src in c.get("envFrom", []):
            if src.get("configMapRef", {}).get("name") == CONFIGMAP:
                src["configMapRef"]["name"] = configmap["metadata"]["name"]
    return configmap


def _localize(deployment: Doc, settings: Mapping[str, str], moved: Mapping[int, int]) -> None:
    """Host network, secret volumes podman 4.3 reads, env without what ``settings`` or podman replace,
    probes on the ``moved`` ports."""
    pod = deployment["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    for vol in pod.get("volumes", []):
        if "secret" in vol:
            # podman 4.3 dereferences `optional` without checking that it was given (a panic).
            vol["secret"].setdefault("optional", False)
    for c in pod["containers"]:
        dropped = {
            e["name"]
            for e in c.get("env", [])
            if e["name"] in settings
            or e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"
        }
        c["env"] = [
            e
            for e in c.get("env", [])
            if e["name"] not in dropped and not any(f"$({n})" in e.get("value", "") for n in dropped)
        ]
        if not c["env"]:
            del c["env"]
        # On the host network there is nothing to map (podman 4.3 refuses port mappings there).
        c.pop("ports", None)
        for _kind, probe in _probes(c):
            get = probe.get("httpGet")
            if get:
                get["port"] = moved.get(get["port"], get["port"])


def podman_secrets(docs: Sequence[Doc], secret_docs: Sequence[Doc]) -> dict[str, bytes]:
    """``secret_docs`` as the podman secrets podman 4.3's kube play reads: name → content.

    That podman reads a secret two ways, neither the Kubernetes one: for a ``secretKeyRef`` the secret
    must be a flat JSON object of base64 values; for a ``secret`` volume a Secret manifest whose
    ``data`` values are the files' bytes as they are (it writes base64 text into the files otherwise,
    and crashes on ``stringData``). A Secret used both ways cannot work there; ours are one or the other.
    """
    as_env: set[str] = set()
    as_volume: set[str] = set()
    for dep in workloads(docs).values():
        pod = dep["spec"]["template"]["spec"]
        as_volume |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    as_env.add(ref["name"])
    out = {}
    for sec in secret_docs:
        name = sec["metadata"]["name"]
        values = {
            **{k: base64.b64decode(v).decode() for k, v in (sec.get("data") or {}).items()},
            **(sec.get("stringData") or {}),
        }
        if name in as_env and name in as_volume:
            raise InfraError(f"Secret {name} is used as env and as a volume: podman 4.3 cannot play that")
        if name in as_env:
            flat = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
            out[name] = json.dumps(flat).encode()
        elif name in as_volume:
            manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": values}
            out[name] = yaml.safe_dump(manifest).encode()
    return out


def dump(docs: Sequence[Doc]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.images.kube", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="validate infra/images/k8s/*.yaml (schemas and cross-references)")
    sec = sub.add_parser("secrets", help="print Secret manifests with real certificates and tokens")
    sec.add_argument("--pki-dir", type=Path, required=True, help="made by `python -m infra pki --dir DIR`")
    sec.add_argument("--control-token", required=True, help="a bearer token with read and write scopes")
    sec.add_argument("--ingest-token", required=True, help="a bearer token for ingest's HTTP API")
    sec.add_argument("--control-redis-url", required=True)
    sec.add_argument("--sink-redis-url", required=True)
    sec.add_argument("--redis-url", default="redis://redis:6379/0")
    sec.add_argument(
        "--kafka-users",
        type=Path,
        required=True,
        help="the brokers' Kafka passwords (`<run dir>/kafka-auth/users.json`)",
    )
    args = parser.parse_args(argv)
    if args.command == "check":
        docs = load()
        problems = validate(docs) + cross_check(docs)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(docs)} manifests in {K8S_DIR}: {'ok' if not problems else f'{len(problems)} problems'}")
        return 1 if problems else 0
    print(
        dump(
            secrets(
                args.pki_dir,
                control_tokens={args.control_token: ["read", "write"]},
                ingest_tokens=[args.ingest_token],
                control_redis_url=args.control_redis_url,
                sink_redis_url=args.sink_redis_url,
                redis_url=args.redis_url,
                kafka_passwords=json.loads(args.kafka_users.read_text()),
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
