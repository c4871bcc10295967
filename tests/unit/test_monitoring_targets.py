"""Prometheus' targets from control's registry: live instances, and a lost one only while no live
instance serves its address (the newest lost one, when several did)."""

from __future__ import annotations

from services.control.monitoring import scrape_targets
from services.control.store import InstanceRecord


def _instance(iid: str, service: str, port: int, health: str = "alive", at: int = 0) -> InstanceRecord:
    return InstanceRecord(
        instance_id=iid,
        service=service,
        host="127.0.0.1",
        grpc_port=port + 1000,
        metrics_port=port,
        version="",
        registered_at_ms=at,
        last_heartbeat_ms=at,
        health=health,
    )


def _ids(groups: list[dict[str, object]]) -> list[tuple[str, str]]:
    return [(g["targets"][0], g["labels"].get("instance_id", "")) for g in groups]  # type: ignore[index,union-attr]


def test_live_instances_and_control_are_targets() -> None:
    groups = scrape_targets(
        [_instance("i1", "ingest", 9101), _instance("s1", "sink", 9103)], "127.0.0.1", 8081
    )
    assert _ids(groups) == [("127.0.0.1:8081", ""), ("127.0.0.1:9101", "i1"), ("127.0.0.1:9103", "s1")]
    assert [g["labels"]["service"] for g in groups] == ["control", "ingest", "sink"]


def test_a_lost_instance_stays_a_target_until_its_address_is_served_again() -> None:
    old = _instance("s0", "sink", 9103, "lost", at=1)
    lost = _instance("s1", "sink", 9103, "lost", at=2)
    assert _ids(scrape_targets([old, lost], "127.0.0.1", 8081))[1:] == [("127.0.0.1:9103", "s1")]
    back = _instance("s2", "sink", 9103, at=3)
    assert _ids(scrape_targets([old, lost, back], "127.0.0.1", 8081))[1:] == [("127.0.0.1:9103", "s2")]


def test_an_instance_without_a_metrics_port_is_not_a_target() -> None:
    assert _ids(scrape_targets([_instance("x", "ingest", 0)], "h", 1)) == [("h:1", "")]
