"""The shared Redis client factory: settings parsed and checked, Sentinel used when configured."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from redis.sentinel import SentinelConnectionPool

from shared.redis_client import redis_client, sentinel_addresses
from shared.settings import BaseServiceSettings


def test_sentinel_addresses_are_parsed_and_a_malformed_one_is_refused() -> None:
    assert sentinel_addresses(" 10.0.0.1:26379, [::1]:26380 ,") == [("10.0.0.1", 26379), ("::1", 26380)]
    assert sentinel_addresses("") == []
    with pytest.raises(ValueError, match="host:port"):
        sentinel_addresses("10.0.0.1")
    with pytest.raises(ValidationError, match="host:port"):
        BaseServiceSettings(redis_sentinels="a:1,b")


def test_without_sentinels_the_client_connects_to_the_url() -> None:
    client = redis_client(BaseServiceSettings(redis_url="redis://sink:pw@10.1.2.3:7000/2"), timeout_s=1)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["username"]) == ("10.1.2.3", 7000, 2, "sink")


def test_with_sentinels_the_client_asks_them_and_keeps_the_urls_user_and_database() -> None:
    settings = BaseServiceSettings(
        redis_url="redis://sink:pw@10.1.2.3:7000/2",
        redis_sentinels="10.0.0.1:26379,10.0.0.2:26379",
        redis_master_name="main",
        redis_sentinel_user="client",
        redis_sentinel_password="secret",
    )
    client = redis_client(settings, timeout_s=1, retries=0, max_connections=1)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "main" and pool.max_connections == 1
    kwargs = pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("sink", "pw", 2)
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["host"] for s in sentinels] == ["10.0.0.1", "10.0.0.2"]
    assert sentinels[0].connection_pool.connection_kwargs["username"] == "client"
