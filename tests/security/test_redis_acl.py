"""Redis answers no one without a password, and each service's user reaches only its own keys."""

from __future__ import annotations

import pytest
import redis

from infra.local.stack import StackConfig, redis_server

pytestmark = pytest.mark.integration


def test_redis_refuses_a_client_without_credentials(redis_url: str, stack_cfg: StackConfig) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=stack_cfg.redis_port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("sf:control:jobs")
    wrong = redis.Redis.from_url(f"redis://control:wrong@127.0.0.1:{stack_cfg.redis_port}/0")
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()


def test_each_service_user_reaches_only_its_keys(redis_url: str, stack_cfg: StackConfig, unique: str) -> None:
    server = redis_server(stack_cfg)
    sink = redis.Redis.from_url(server.url("sink"))
    control = redis.Redis.from_url(server.url("control"))
    sink.hset(f"sf:job:{unique}:win:a:0", "version", 1)  # results: the sink's
    with pytest.raises(redis.exceptions.NoPermissionError):
        sink.set(f"sf:control:job:{unique}", "{}")  # the job store is control's
    control.hset("sf:control:outputs", unique, "aggregates")  # the jobs control knows, for the sink
    assert sink.hget("sf:control:outputs", unique) == b"aggregates"
    with pytest.raises(redis.exceptions.NoPermissionError):
        sink.hset("sf:control:outputs", unique, "forged")  # read, never written
    with pytest.raises(redis.exceptions.NoPermissionError):
        sink.config_get("*")  # admin commands: the default user's only
    with pytest.raises(redis.exceptions.NoPermissionError):
        control.flushall()  # dangerous commands too
    control.set(f"sf:control:job:{unique}", "{}")
    assert control.hget(f"sf:job:{unique}:win:a:0", "version") == b"1"  # control serves results
    with pytest.raises(redis.exceptions.NoPermissionError):
        control.set(f"other:{unique}", "x")
