"""The job store and the service registry's records, in Redis (layout in shared.constants).

Everything control knows lives here, so a restarted control loses no job and no state. Each record is
one JSON value; updates are optimistic transactions (WATCH/MULTI) so the API threads, the gRPC
threads and the supervisor never overwrite each other's changes. A new job is stored durably when
``wait_replicas`` is set: its transaction is followed by WAIT, so the job a client was told about
(201) survives a failover of the Redis primary. With a ``Fence`` (the leader election) every write
also watches the leader term and is refused once a newer leader took over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Literal, Protocol, TypeVar

import orjson
import redis
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.control.errors import JobConflict, NotLeader, StoreUnavailable
from shared import constants
from shared.errors import SpecError
from shared.jobspec import JobSpec, spec_from_json
from shared.jobstate import JobState
from shared.redis_client import DurableTransaction, NotReplicated

HISTORY_LIMIT = 50


class Transition(BaseModel):
    state: JobState
    at_ms: int
    message: str = ""


class JobRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    # The validated spec's canonical JSON text (shared.jobspec.spec_to_json): what StartJob and
    # ApplyStreams send as is; ``spec`` gives it parsed.
    spec_json: str
    state: JobState = JobState.CREATED
    message: str = ""  # why the job is in its state (FAILING, FAILED, CANCELED...)
    processor: str = ""  # instance id of the processor the job was last placed on
    owner: str = ""  # a digest of the API token that submitted it ("" without tokens)
    placed_at_ms: int = 0
    created_at_ms: int
    updated_at_ms: int
    from_savepoint: str = ""
    # A stop with savepoint was asked for (CANCELLING then ends FINISHED with savepoint_path).
    savepoint_requested: bool = False
    savepoint_dir: str = ""
    savepoint_path: str = ""
    # FAILING because control must start it again (processor lost or gave up), not because the
    # processor is restarting it by itself.
    needs_start: bool = False
    # No start or stop is retried before this time (set after a failed or still-pending attempt).
    next_attempt_ms: int = 0
    restarts: int = 0  # failures a processor reported, counted against max_restarts
    recoveries: int = 0  # restarts because the processor holding the job was lost
    metrics: dict[str, float] = Field(default_factory=dict)
    metrics_at_ms: int = 0
    history: list[Transition] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _spec_as_text(cls, data: Any) -> Any:
        # Records written before specs were kept as text hold the spec as a JSON object.
        # orjson keeps the object's key order, so the text is the one spec_to_json wrote then.
        if isinstance(data, dict) and "spec_json" not in data and isinstance(data.get("spec"), dict):
            spec = data["spec"]
            data = {k: v for k, v in data.items() if k != "spec"}
            data["spec_json"] = orjson.dumps(spec).decode()
        return data

    @property
    def spec(self) -> JobSpec:
        """The spec, parsed once per process (SpecError if it no longer validates)."""
        return spec_from_json(self.spec_json)

    def moved_to(self, state: JobState, now_ms: int, message: str = "") -> JobRecord:
        """A copy in ``state`` with the transition recorded (legality is the caller's check)."""
        history = [*self.history, Transition(state=state, at_ms=now_ms, message=message)][-HISTORY_LIMIT:]
        return self.model_copy(
            update={
                "state": state,
                "message": message,
                "updated_at_ms": now_ms,
                "history": history,
                "next_attempt_ms": 0,  # a new state: its first command goes out at once
            }
        )


Health = Literal["alive", "lost"]


class InstanceRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instance_id: str
    service: str
    host: str
    grpc_port: int
    metrics_port: int
    version: str = ""
    registered_at_ms: int
    last_heartbeat_ms: int
    health: Health = "alive"
    lost_at_ms: int = 0
    lost_reason: str = ""  # how control learnt it was gone (heartbeat timeout, connection refused)
    load: dict[str, float] = Field(default_factory=dict)
    jobs: list[str] = Field(default_factory=list)  # what a processor says it runs
    slots: dict[str, int] = Field(default_factory=dict)  # a processor's task slots (shared/slots.py)
    grpc_health: str = "UNKNOWN"  # the instance's own grpc.health.v1 answer, probed by control
    grpc_health_at_ms: int = 0
    streams_digest: str = ""  # digest of the job specs this ingest/sink last accepted
    streams_error: str = ""
    streams_attempt_ms: int = 0

    @property
    def target(self) -> str:
        return f"{self.host}:{self.grpc_port}"


class Fence(Protocol):
    """Who may write: the leader election (services/control/leader.py)."""

    def check(self) -> int:
        """The term this replica leads in, or raise NotLeader."""
        ...

    def deposed(self, term: int) -> NotLeader:
        """The store holds a newer term than ``term``: the error to raise."""
        ...


R = TypeVar("R", bound=BaseModel)
Pipeline = Any  # redis.client.Pipeline, in immediate mode after WATCH


def watch_fenced(pipe: Pipeline, fence: Fence | None, *keys: str) -> list[Any]:
    """WATCH ``keys`` (and the leader term, when fenced) and return their values.

    Fenced, it raises NotLeader unless the stored term is the one this replica leads in; a new leader's
    INCR after this read makes the transaction's EXEC fail (WatchError), and the retry is refused here.
    """
    if fence is None:
        pipe.watch(*keys)
        return list(pipe.mget(keys)) if len(keys) > 1 else [pipe.get(keys[0])]
    term = fence.check()
    pipe.watch(*keys, constants.REDIS_CONTROL_TERM)
    *values, stored = pipe.mget([*keys, constants.REDIS_CONTROL_TERM])
    if stored is None or int(stored) != term:
        pipe.unwatch()
        raise fence.deposed(term)
    return values


class _Records(Generic[R]):
    def __init__(
        self, client: redis.Redis, model: type[R], key_of: Callable[[str], str], fence: Fence | None
    ) -> None:
        self.client = client
        self.model = model
        self.key_of = key_of
        self.fence = fence

    def _load(self, raw: bytes | str | None) -> R | None:
        return None if raw is None else self.model.model_validate_json(raw)

    def get(self, record_id: str) -> R | None:
        try:
            return self._load(self.client.get(self.key_of(record_id)))
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e

    def get_many(self, ids: list[str]) -> list[R]:
        if not ids:
            return []
        try:
            raws = self.client.mget([self.key_of(i) for i in ids])
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e
        return [r for r in (self._load(raw) for raw in raws) if r is not None]

    def update(self, record_id: str, change: Callable[[R], R | None]) -> R | None:
        """Apply ``change`` atomically; it returns the new record, or None to leave it as it is.

        Returns the stored record afterwards (None if there is no such record). ``change`` may raise
        (e.g. IllegalTransition): nothing is written then.
        """
        key = self.key_of(record_id)
        try:
            with self.client.pipeline() as pipe:
                while True:
                    try:
                        (raw,) = watch_fenced(pipe, self.fence, key)
                        current = self._load(raw)
                        if current is None:
                            pipe.unwatch()
                            return None
                        new = change(current)
                        if new is None:
                            pipe.unwatch()
                            return current
                        pipe.multi()
                        pipe.set(key, new.model_dump_json())
                        pipe.execute()
                        return new
                    except redis.WatchError:
                        continue  # someone else changed it between our read and write: read again
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e


class JobStore:
    def __init__(
        self,
        client: redis.Redis,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1_000,
        fence: Fence | None = None,
    ) -> None:
        self.client = client
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.fence = fence
        self._records: _Records[JobRecord] = _Records(
            client, JobRecord, constants.redis_control_job_key, fence
        )

    def create(self, job: JobRecord) -> JobRecord:
        """Store a new job; an existing job with that id is replaced only once it is final.

        With ``wait_replicas`` it returns once that many replicas have the job too; StoreUnavailable
        when they did not acknowledge it in time (the primary may still hold it)."""
        key = constants.redis_control_job_key(job.id)
        output = output_topic(job)
        try:
            with DurableTransaction(self.client, self.wait_replicas, self.wait_timeout_ms) as pipe:
                while True:
                    try:
                        (raw,) = watch_fenced(pipe, self.fence, key)
                        existing = self._records._load(raw)
                        # Our own write, applied before a retried call (its connection broke after EXEC).
                        ours = existing is not None and existing.model_dump_json() == job.model_dump_json()
                        if existing is not None and not existing.state.is_final and not ours:
                            pipe.unwatch()
                            raise JobConflict(
                                f"job {job.id!r} already exists and is {existing.state}; cancel it "
                                "(POST /jobs/{id}/cancel) and wait for it to end, or submit under another id"
                            )
                        pipe.multi()
                        pipe.set(key, job.model_dump_json())
                        pipe.zadd(constants.REDIS_CONTROL_JOBS, {job.id: job.created_at_ms})
                        # With the job, before any processor is told of it: the sink knows the job
                        # before its first result can reach it.
                        if output is not None:
                            pipe.hset(constants.REDIS_CONTROL_OUTPUTS, job.id, output)
                        pipe.execute()
                        return job
                    except redis.WatchError:
                        continue
        except NotReplicated as e:
            raise StoreUnavailable(f"job {job.id!r} is not yet on a Redis replica ({e}); try again") from e
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e

    def index_outputs(self) -> None:
        """Store every job's output topic for the sink (jobs stored before the index existed)."""
        try:
            outputs = [(job.id, output) for job in self.list() if (output := output_topic(job)) is not None]
            with self.client.pipeline(transaction=False) as pipe:
                for job_id, output in outputs:
                    pipe.hset(constants.REDIS_CONTROL_OUTPUTS, job_id, output)
                pipe.execute()
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e

    def get(self, job_id: str) -> JobRecord | None:
        return self._records.get(job_id)

    def ids(self) -> list[str]:
        try:
            raw: list[bytes] = self.client.zrange(constants.REDIS_CONTROL_JOBS, 0, -1)  # type: ignore[assignment]
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e
        return [_text(i) for i in raw]

    def list(self) -> list[JobRecord]:
        """Every job, oldest submission first."""
        return self._records.get_many(self.ids())

    def update(self, job_id: str, change: Callable[[JobRecord], JobRecord | None]) -> JobRecord | None:
        return self._records.update(job_id, change)


class InstanceStore:
    def __init__(self, client: redis.Redis, fence: Fence | None = None) -> None:
        self.client = client
        self.fence = fence
        self._records: _Records[InstanceRecord] = _Records(
            client, InstanceRecord, constants.redis_control_instance_key, fence
        )

    def _write(self, instance_id: str, write: Callable[[Pipeline], None]) -> None:
        """``write`` queues the commands of one transaction, fenced by the leader term."""
        key = constants.redis_control_instance_key(instance_id)
        try:
            with self.client.pipeline() as pipe:
                while True:
                    try:
                        if self.fence is not None:
                            watch_fenced(pipe, self.fence, key)
                        pipe.multi()
                        write(pipe)
                        pipe.execute()
                        return
                    except redis.WatchError:
                        continue
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e

    def put(self, instance: InstanceRecord) -> None:
        def write(pipe: Pipeline) -> None:
            pipe.set(constants.redis_control_instance_key(instance.instance_id), instance.model_dump_json())
            pipe.sadd(constants.REDIS_CONTROL_INSTANCES, instance.instance_id)

        self._write(instance.instance_id, write)

    def get(self, instance_id: str) -> InstanceRecord | None:
        return self._records.get(instance_id)

    def alive(self, service: str | None = None) -> list[InstanceRecord]:
        """The instances that heartbeat (of one service, if given)."""
        return [i for i in self.list() if i.health == "alive" and (service is None or i.service == service)]

    def alive_ids(self) -> set[str]:
        return {i.instance_id for i in self.alive()}

    def is_alive(self, instance_id: str) -> bool:
        record = self.get(instance_id) if instance_id else None
        return record is not None and record.health == "alive"

    def list(self) -> list[InstanceRecord]:
        try:
            members: set[bytes] = self.client.smembers(constants.REDIS_CONTROL_INSTANCES)  # type: ignore[assignment]
            ids = sorted(_text(i) for i in members)
        except redis.RedisError as e:
            raise StoreUnavailable(f"the job store (Redis) is unavailable: {e}") from e
        return self._records.get_many(ids)

    def update(
        self, instance_id: str, change: Callable[[InstanceRecord], InstanceRecord | None]
    ) -> InstanceRecord | None:
        return self._records.update(instance_id, change)

    def delete(self, instance_id: str) -> None:
        def write(pipe: Pipeline) -> None:
            pipe.delete(constants.redis_control_instance_key(instance_id))
            pipe.srem(constants.REDIS_CONTROL_INSTANCES, instance_id)

        self._write(instance_id, write)


def output_topic(job: JobRecord) -> str | None:
    """Where the job writes; None for a spec the format has moved past (it runs nowhere)."""
    try:
        return job.spec.output_topic
    except SpecError:
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
