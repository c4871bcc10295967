"""The multi-host layout (infra/hosts/topology.py): no host whose loss stops Redis or control."""

from __future__ import annotations

from pathlib import Path

from infra.hosts import topology as hosts


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
