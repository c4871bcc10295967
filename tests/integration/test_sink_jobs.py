"""The sink writes results only of jobs control stored, from their own output topic (real Kafka, Redis).

A forged row (a job nobody submitted, a job's row on another job's topic, an epoch a fence ended) goes to
the dead-letter topic with its reason; a valid row beside them is written. The jobs are stored through
control's own job store, and the sink reads them with its own Redis user.
"""

from __future__ import annotations

import pytest
import redis
from prometheus_client import REGISTRY

from infra.local.stack import StackConfig, redis_server
from services.control.store import JobRecord, JobStore
from services.processor.jobs.fence import publish_fence
from services.sink.consumer import Sink
from services.sink.settings import SinkSettings
from shared import constants
from shared.jobspec import JobSpec, spec_to_json
from shared.jobstate import JobState
from shared.kafka import ensure_topics
from tests.integration.test_sink import (  # noqa: F401 (started is a fixture)
    produce_updates,
    redis_state,
    run_until,
    start,
    started,
    update,
)
from tests.kafka_util import read_all

pytestmark = pytest.mark.integration


def store_job(store: JobStore, job_id: str, output_topic: str) -> None:
    """As POST /jobs does, before any processor is told of the job."""
    spec = JobSpec.model_validate(
        {
            "id": job_id,
            "source": {
                "topic": f"{job_id}-raw",
                "fields": {"page": "string", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "5s"},
            "output_topic": output_topic,
        }
    )
    record = JobRecord(id=job_id, spec_json=spec_to_json(spec), created_at_ms=1, updated_at_ms=1)
    store.create(record.moved_to(JobState.CREATED, 1, "submitted"))


def dead_letters(bootstrap: str, topic: str, count: int) -> dict[str, tuple[str, str]]:
    """Job id -> (error class, reason) of the dead letters of ``topic``."""
    found = {}
    for msg in read_all(bootstrap, constants.dlq_topic(topic), min_count=count):
        headers = {k: (v or b"").decode() for k, v in msg.headers() or []}
        job_id = (msg.key() or b"").decode().split("|")[0]
        found[job_id] = (headers[constants.HDR_ERROR_CLASS], headers[constants.HDR_ERROR_MESSAGE])
    return found


def test_rows_of_unknown_jobs_other_topics_and_stale_epochs_go_to_dead_letters_a_valid_one_to_redis(
    kafka_bootstrap: str,
    redis_client: redis.Redis,
    stack_cfg: StackConfig,
    unique: str,
    started: list[Sink],  # noqa: F811
) -> None:
    topic, other = f"{unique}.aggregates", f"{unique}-other.aggregates"
    ensure_topics(kafka_bootstrap, [topic, other], partitions=1)
    store = JobStore(redis_client)
    job, neighbour, forged, stale_job = unique, f"{unique}-b", f"{unique}-forged", f"{unique}-s"
    store_job(store, job, topic)
    store_job(store, neighbour, other)
    store_job(store, stale_job, topic)
    settings = SinkSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_server(stack_cfg).url("sink"),
        topics=[topic, other],
        commit_interval_ms=50,
        tuning_overrides={"group_id": unique, "batch_max_wait_ms": 100},
    )
    assert settings.known_jobs_only  # the default
    sink = start(started, settings)

    valid = update(job, "a", 0, (4 << 32) + 1, 10)
    # The attack of the issue: a forged count at version 10^15 for a job nobody submitted.
    produce_updates(kafka_bootstrap, topic, [valid, update(forged, "a", 0, 10**15, 424242)])
    produce_updates(kafka_bootstrap, topic, [update(neighbour, "a", 0, 5, 55)])  # it writes to `other`
    produce_updates(kafka_bootstrap, topic, [update(stale_job, "a", 0, (4 << 32) + 1, 1)])
    assert publish_fence(kafka_bootstrap, topic, stale_job, 5) == 1
    produce_updates(kafka_bootstrap, topic, [update(stale_job, "a", 0, (4 << 32) + 9, 999)])
    run_until(sink, lambda: redis_state(redis_client, stale_job) == {("a", 0): ((4 << 32) + 1, 1)})
    run_until(sink, lambda: not sink.uncommitted)

    letters = dead_letters(kafka_bootstrap, topic, 3)
    assert letters[forged][0] == "UnknownJob" and "not a job control knows" in letters[forged][1]
    assert letters[neighbour][0] == "WrongTopic" and f"writes to {other!r}" in letters[neighbour][1]
    assert letters[stale_job][0] == "StaleEpoch"
    assert redis_state(redis_client, job) == {("a", 0): (valid.version, 10)}
    assert redis_state(redis_client, forged) == {}
    assert redis_state(redis_client, neighbour) == {}


def test_a_job_stored_after_the_sink_refused_its_id_is_written_from_its_first_row(
    kafka_bootstrap: str,
    redis_client: redis.Redis,
    stack_cfg: StackConfig,
    unique: str,
    started: list[Sink],  # noqa: F811
) -> None:
    """The sink caches what it read; a job submitted since must not meet a stale cache."""
    topic = f"{unique}.aggregates"
    ensure_topics(kafka_bootstrap, [topic], partitions=1)
    settings = SinkSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_server(stack_cfg).url("sink"),
        topics=[topic],
        commit_interval_ms=50,
        tuning_overrides={"group_id": unique, "batch_max_wait_ms": 100},
    )
    sink = start(started, settings)
    labels = {"service": "sink", "job": "unknown", "reason": "UnknownJob"}

    def refused() -> float:
        return REGISTRY.get_sample_value("dlq_events_total", labels) or 0.0

    before = refused()
    produce_updates(kafka_bootstrap, topic, [update(unique, "early", 0, 1, 1)])
    run_until(sink, lambda: refused() > before)
    assert dead_letters(kafka_bootstrap, topic, 1)[unique][0] == "UnknownJob"

    store_job(JobStore(redis_client), unique, topic)  # submitted now; its processor writes after
    produce_updates(kafka_bootstrap, topic, [update(unique, "a", 0, 1, 7)])
    run_until(sink, lambda: redis_state(redis_client, unique) == {("a", 0): (1, 7)})
    assert redis_state(redis_client, unique) == {("a", 0): (1, 7)}  # "early" stayed out
