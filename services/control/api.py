"""The FastAPI application: health, readiness, metrics and job results."""

from __future__ import annotations

from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from services.control.results import read_results
from services.control.settings import ControlSettings
from shared.kafka import check_metadata


class WindowOut(BaseModel):
    key: str
    window_start: int
    window_end: int
    version: int
    final: bool
    updated_at_ms: int
    aggregates: dict[str, Any]


class ResultsOut(BaseModel):
    job_id: str
    count: int
    results: list[WindowOut]


def get_redis(request: Request) -> redis.Redis:
    client: redis.Redis = request.app.state.redis
    return client


RedisDep = Annotated[redis.Redis, Depends(get_redis)]


def create_app(settings: ControlSettings) -> FastAPI:
    app = FastAPI(title="StreamForge control API", version="0.1.0")
    app.state.settings = settings
    app.state.redis = redis.Redis.from_url(settings.redis_url, socket_timeout=5)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Alive: the process answers. Says nothing about its dependencies (see /readyz)."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz(client: RedisDep, response: Response) -> dict[str, Any]:
        """Ready: Redis answers PING and Kafka answers a metadata request."""
        checks = {"redis": _redis_ok(client), "kafka": check_metadata(settings.kafka_bootstrap)}
        ready = all(checks.values())
        response.status_code = 200 if ready else 503
        return {"ready": ready, "checks": checks}

    @app.get("/metrics", tags=["health"], response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/jobs/{job_id}/results", tags=["jobs"], response_model=ResultsOut)
    def job_results(
        job_id: str,
        client: RedisDep,
        key: Annotated[str | None, Query(description="only this key")] = None,
        start: Annotated[int | None, Query(description="windows starting at or after (epoch ms)")] = None,
        end: Annotated[int | None, Query(description="windows starting before (epoch ms)")] = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> ResultsOut:
        if start is not None and end is not None and end <= start:
            raise HTTPException(422, f"end ({end}) must be greater than start ({start})")
        windows = read_results(client, job_id, key, start, end, limit)
        return ResultsOut(job_id=job_id, count=len(windows), results=[WindowOut(**w) for w in windows])

    return app


def _redis_ok(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
