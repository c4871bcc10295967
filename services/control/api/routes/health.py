"""Liveness, readiness and Prometheus metrics: open to probes, no token needed."""

from __future__ import annotations

from typing import Any

import redis
from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import shared.metrics  # noqa: F401  # the design's shared families, on every service's /metrics
from services.control.api.deps import PlaneDep, SettingsDep
from shared.kafka import check_metadata

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Alive: the process answers. Says nothing about its dependencies (see /readyz)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "a dependency is down (see checks)"}})
async def readyz(plane: PlaneDep, settings: SettingsDep, response: Response) -> dict[str, Any]:
    """Ready: Redis answers PING, Kafka answers a metadata request and the gRPC Registry listens."""
    checks = {
        "redis": await run_in_threadpool(_redis_ok, plane.redis),
        "kafka": await run_in_threadpool(check_metadata, settings.kafka),
        "grpc": plane.started and plane.grpc.port > 0,
    }
    ready = all(checks.values())
    response.status_code = 200 if ready else 503
    # A standby is ready too: it serves reads and takes over when the leader goes.
    return {"ready": ready, "checks": checks, "leader": plane.leader.is_leader()}


@router.get("/leader")
async def leader(plane: PlaneDep) -> dict[str, Any]:
    """Which replica leads control (from the lease in Redis), and whether this one does."""
    try:
        current = await run_in_threadpool(plane.leader.current)
    except redis.RedisError:
        current = None
    return {
        "replica": plane.replica_id,
        "leader": plane.leader.is_leader(),
        "leader_replica": current.replica.replica_id if current else "",
        "leader_api_url": current.replica.api_url if current else "",
        "leader_grpc_target": current.replica.grpc_target if current else "",
        "term": current.term if current else 0,
    }


@router.get("/metrics", response_class=Response)
def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _redis_ok(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
