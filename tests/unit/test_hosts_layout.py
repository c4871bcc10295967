"""The multi-host layout (infra/hosts/topology.py): no host whose loss stops Redis or control."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cryptography import x509

from infra.hosts import topology as hosts
from infra.local.stack import kafka_service_env
from infra.pki import ensure_pem_keystore, ensure_pki


def _host_index(process: str) -> int:
    return hosts.host_of(process).index


def test_every_process_runs_on_exactly_one_host() -> None:
    names = [p for procs in hosts.LAYOUT.values() for p in procs]
    assert len(names) == len(set(names))
    assert len(hosts.LAYOUT) == hosts.HOSTS


def test_redis_nodes_sentinels_and_controls_never_share_a_host_with_each_other() -> None:
    nodes = {_host_index(f"redis-{i}") for i in (1, 2)}
    controls = {_host_index(c) for c in hosts.CONTROLS}
    sentinels = {_host_index(f"redis-sentinel-{i}") for i in (1, 2, 3)}
    assert len(nodes) == 2 and len(controls) == 2 and len(sentinels) == 3
    # Losing a Redis node's or a control's host leaves every Sentinel (a quorum of 2 survives any one).
    assert not (nodes | controls) & sentinels
    assert not nodes & controls
    # Nor does it take a part that has a single copy, or a processor.
    single = {
        _host_index(p) for p in ("hdfs-namenode", "spark-master", "kafka-1", hosts.ACTIVE, hosts.STANDBY)
    }
    assert not (nodes | controls) & single


def test_clients_list_every_sentinel_and_control_replica(tmp_path: Path) -> None:
    cfg = hosts.HostsConfig(run_dir=tmp_path, control_token="token-for-tests")
    stack = hosts.stack_config(cfg)
    assert stack.control_urls == [
        f"http://{hosts.host_of(c).address}:{stack.control_port}" for c in hosts.CONTROLS
    ]
    assert len(stack.control_grpc_targets.split(",")) == 2
    ha = hosts.redis_ha(cfg)
    assert stack.redis_sentinels == ha.sentinel_list
    assert ha.sentinel_list.count(f":{hosts.SENTINEL_PORT}") == 3
    # Each node and Sentinel keeps its files on its own host, with that host's copy of the passwords.
    for server in ha.servers():
        assert server.run_dir == hosts.run_dir_of(cfg, server.name)
        assert server.auth_dir == server.run_dir / "redis-auth"
        assert server.where.netns == hosts.host_of(server.name).netns
    for sentinel in ha.sentinel_processes():
        assert sentinel.run_dir == hosts.run_dir_of(cfg, sentinel.name)
        assert sentinel.monitor == (hosts.host_of("redis-1").address, hosts.REDIS_PORT)
    for r in hosts.replicas(cfg):
        if r.service in ("control", "sink"):
            assert r.env["SF_REDIS_SENTINELS"] == ha.sentinel_list
            assert r.env["SF_REDIS_WAIT_REPLICAS"] == "1"


def _props(text: str) -> dict[str, str]:
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return dict(ln.split("=", 1) for ln in lines)


def test_every_kafka_listener_between_hosts_takes_sasl_over_tls(tmp_path: Path) -> None:
    cfg = hosts.HostsConfig(run_dir=tmp_path)
    ca_file = tmp_path / "pki" / "ca.crt"
    ensure_pki(tmp_path / "pki", ())
    ca = x509.load_pem_x509_certificate(ca_file.read_bytes())
    for node in hosts.kafka(cfg).nodes:
        address = hosts.host_of(node.name).address
        props = _props(node.server_properties())
        assert (
            props["listeners"]
            == f"CLIENT://{address}:{hosts.KAFKA_PORT},CONTROLLER://{address}:{hosts.CONTROLLER_PORT}"
        )
        assert props["listener.security.protocol.map"] == "CLIENT:SASL_SSL,CONTROLLER:SASL_SSL"
        assert props["sasl.mechanism.inter.broker.protocol"] == "SCRAM-SHA-512"
        assert props["sasl.mechanism.controller.protocol"] == "PLAIN"
        assert props["ssl.truststore.type"] == props["ssl.keystore.type"] == "PEM"
        assert props["ssl.truststore.location"] == str(ca_file)
        assert props["ssl.endpoint.identification.algorithm"] == "https"
        keystore = Path(props["ssl.keystore.location"])
        assert keystore.stat().st_mode & 0o777 == 0o600
        pem = keystore.read_bytes()
        assert b"PRIVATE KEY" in pem
        cert = x509.load_pem_x509_certificate(pem)
        # Signed by the project CA, for this node's own address (what its peers' https check asks).
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert ipaddress.ip_address(address) in sans.get_values_for_type(x509.IPAddress)
    # Every client (services, Spark's source and sink, the tests) trusts that CA over SASL_SSL.
    stack = hosts.stack_config(cfg)
    assert stack.kafka.config()["security.protocol"] == "sasl_ssl"
    assert stack.kafka.config()["ssl.ca.location"] == str(ca_file)
    spark = stack.kafka_access("processor").spark_options()
    assert spark["kafka.security.protocol"] == "SASL_SSL"
    assert spark["kafka.ssl.truststore.location"] == str(ca_file)
    for r in hosts.replicas(cfg):
        env = kafka_service_env(hosts.host_stack(cfg, r.host), r.service)
        assert env["SF_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", r.process
        assert env["SF_KAFKA_SSL_CA_FILE"] == str(ca_file), r.process


def test_a_broker_certificate_is_kept_until_its_address_changes(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    first = ensure_pem_keystore(pki, "kafka-1", ["10.9.0.2"]).read_bytes()
    assert ensure_pem_keystore(pki, "kafka-1", ["10.9.0.2"]).read_bytes() == first
    moved = x509.load_pem_x509_certificate(ensure_pem_keystore(pki, "kafka-1", ["10.9.0.7"]).read_bytes())
    sans = moved.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.9.0.7") in sans.get_values_for_type(x509.IPAddress)
    # A new CA (same name, new key) gets a certificate its clients can check.
    (pki / "ca.key").unlink()
    ensure_pki(pki, ())
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    renewed = x509.load_pem_x509_certificate(ensure_pem_keystore(pki, "kafka-1", ["10.9.0.7"]).read_bytes())
    renewed.verify_directly_issued_by(ca)
