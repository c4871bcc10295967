"""Every service's Redis client: one Redis server, or the primary Redis Sentinel names, followed
across failovers.

With ``SF_REDIS_SENTINELS`` empty the client connects to ``SF_REDIS_URL``. With it set, the client asks
the Sentinels (as ``SF_REDIS_SENTINEL_USER``) for the primary of ``SF_REDIS_MASTER_NAME`` and connects
there with the user, password and database of ``SF_REDIS_URL``, whose host and port then only name the
first primary. A connection that breaks, or that finds its node demoted (READONLY), asks the Sentinels
again on its next attempt.

Replication is asynchronous: a write the primary acknowledged is lost if the primary dies before a
replica has it. ``WAIT n timeout`` blocks until ``n`` replicas acknowledged every write made on that
connection so far; ``DurableTransaction`` sends it after a MULTI/EXEC on the same connection. It does
not make Redis strongly consistent: a write that WAIT did not confirm may still be applied, or lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.client import Pipeline
from redis.connection import Connection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel

from shared.settings import BaseServiceSettings

# What a failover looks like to a client: the primary's connection breaks or times out, the Sentinels
# name no primary for a moment (MasterNotFoundError is a ConnectionError), or a node that was demoted
# refuses writes (READONLY).
FAILOVER_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)
# Retries of a call that met FAILOVER_ERRORS, backing off up to FAILOVER_BACKOFF_CAP_S each: together
# they outlast a failover that Sentinel finishes in a few seconds, then the error reaches the caller.
FAILOVER_RETRIES = 12
FAILOVER_BACKOFF_BASE_S = 0.05
FAILOVER_BACKOFF_CAP_S = 1.0


class NotReplicated(redis.RedisError):
    """The write was applied by the primary, but fewer replicas than asked acknowledged it in time:
    a failover now could lose it. Writing it again is how to retry."""


def sentinel_addresses(text: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` -> [(host, port), ...] (ValueError on a malformed entry)."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a Sentinel address is host:port, got {item!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def failover_retry(retries: int = FAILOVER_RETRIES) -> Retry:
    """Retry calls that met a failover, with bounded, jittered exponential backoff (0: never)."""
    if retries == 0:
        return Retry(NoBackoff(), 0)
    backoff = EqualJitterBackoff(cap=FAILOVER_BACKOFF_CAP_S, base=FAILOVER_BACKOFF_BASE_S)
    return Retry(backoff, retries, supported_errors=FAILOVER_ERRORS)


def redis_client(
    settings: BaseServiceSettings,
    *,
    timeout_s: float,
    retries: int = FAILOVER_RETRIES,
    on_connect: Callable[[], None] | None = None,
    max_connections: int | None = None,
) -> redis.Redis:
    """The Redis client of a service: its user (``SF_REDIS_URL``), through Sentinel when configured.

    ``timeout_s`` bounds each socket operation; ``retries`` calls that meet a failover are retried
    (0: the caller handles every error itself). ``on_connect`` runs after every (re)connection, which
    may reach another primary than before. ``max_connections`` caps the pool: 1 makes every call use
    the same connection, which WAIT needs to cover the caller's earlier writes.
    """
    return connect(
        settings.redis_url,
        sentinels=settings.redis_sentinels,
        master_name=settings.redis_master_name,
        sentinel_user=settings.redis_sentinel_user,
        sentinel_password=settings.redis_sentinel_password.get_secret_value(),
        timeout_s=timeout_s,
        retries=retries,
        on_connect=on_connect,
        max_connections=max_connections,
    )


def connect(
    url: str,
    *,
    sentinels: str = "",
    master_name: str = "",
    sentinel_user: str = "",
    sentinel_password: str = "",
    timeout_s: float,
    retries: int = FAILOVER_RETRIES,
    on_connect: Callable[[], None] | None = None,
    max_connections: int | None = None,
) -> redis.Redis:
    """redis_client without a service's settings: ``url`` (its credentials and database), the
    primary of ``master_name`` that the Sentinels at ``sentinels`` name when that is not empty."""
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": failover_retry(retries),
    }
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if on_connect is not None:
        hook = on_connect

        def connected(connection: Connection) -> None:
            connection.on_connect()  # AUTH, SELECT, ... as without a hook
            hook()

        kwargs["redis_connect_func"] = connected
    addresses = sentinel_addresses(sentinels)
    if not addresses:
        return redis.Redis.from_url(url, **kwargs)
    target = parse_url(url)
    sentinel_auth = {
        "username": sentinel_user or None,
        "password": sentinel_password or None,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    manager = Sentinel(addresses, sentinel_kwargs=sentinel_auth)
    return manager.master_for(
        master_name,
        username=target.get("username"),
        password=target.get("password"),
        db=target.get("db", 0),
        **kwargs,
    )


class DurableTransaction(Pipeline):
    """A MULTI/EXEC transaction (WATCH allowed) followed on the same connection by WAIT for
    ``replicas`` replicas; execute() raises NotReplicated when fewer acknowledged within
    ``timeout_ms``. With ``replicas`` 0 it is a plain transaction."""

    def __init__(self, client: redis.Redis, replicas: int, timeout_ms: int) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, True, None)
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.acknowledged = -1

    def _execute_transaction(self, connection: Connection, commands: Any, raise_on_error: Any) -> list[Any]:
        result: list[Any] = super()._execute_transaction(connection, commands, raise_on_error)
        if self.replicas > 0:
            # Still inside execute(): the connection that ran EXEC, so WAIT covers its writes.
            connection.send_command("WAIT", self.replicas, self.timeout_ms)
            self.acknowledged = int(connection.read_response())
            if self.acknowledged < self.replicas:
                raise NotReplicated(
                    f"{self.acknowledged} of {self.replicas} replica(s) acknowledged the write within "
                    f"{self.timeout_ms} ms"
                )
        return result


def wait_for_replicas(client: redis.Redis, replicas: int, timeout_ms: int) -> int:
    """WAIT on ``client``: how many replicas acknowledged its connection's writes (pass a client
    whose pool holds one connection, see redis_client)."""
    if replicas <= 0:
        return 0
    return int(client.execute_command("WAIT", replicas, timeout_ms))
