"""What a job needs of a processor's task slots (shared/slots.py), and the spec and SDK that set it."""

from __future__ import annotations

from typing import Any

import pytest

from client.sdk import Job, count, tumbling
from shared.errors import SpecError
from shared.jobspec import JobSpec, parse_job_spec, spec_to_json
from shared.slots import BATCH, REALTIME, SlotNeed, Slots, slots_needed


def spec(**extra: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "id": "views",
            "source": {
                "topic": "clicks",
                "fields": {"page": "string", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "5s"},
            **extra,
        }
    )


def partitions(counts: dict[str, int]) -> Any:
    return lambda topic: counts[topic]


def test_a_micro_batch_job_needs_its_parallelism_of_the_batch_pool() -> None:
    assert slots_needed(spec(), partitions({})) == SlotNeed(BATCH, 1)
    assert slots_needed(spec(parallelism=3), partitions({})) == SlotNeed(BATCH, 3)


def test_a_real_time_job_holds_a_slot_per_source_partition_and_one_for_its_window() -> None:
    rt = spec(trigger_mode="real_time")
    assert slots_needed(rt, partitions({"clicks.valid": 4})) == SlotNeed(REALTIME, 5)
    # A parallelism below what it holds anyway changes nothing; above, it reserves more.
    assert (
        slots_needed(spec(trigger_mode="real_time", parallelism=2), partitions({"clicks.valid": 4})).count
        == 5
    )
    assert (
        slots_needed(spec(trigger_mode="real_time", parallelism=8), partitions({"clicks.valid": 4})).count
        == 8
    )


def test_free_slots_are_the_pool_less_what_is_held() -> None:
    pools = Slots(batch=8, realtime=4)
    held = pools.holding([SlotNeed(BATCH, 3), SlotNeed(REALTIME, 4), SlotNeed(BATCH, 1)])
    assert (held.free(BATCH), held.free(REALTIME)) == (4, 0)
    assert Slots.of_proto(held.to_proto()) == held == Slots.of_dict(held.to_dict())
    assert not Slots().advertised and pools.advertised


def test_parallelism_is_part_of_the_spec_and_of_the_sdk() -> None:
    assert spec(parallelism=4).parallelism == 4
    assert '"parallelism"' not in spec_to_json(spec())  # specs without it keep their canonical text
    with pytest.raises(SpecError, match="parallelism"):
        parse_job_spec(spec_to_json(spec()).replace('"id"', '"parallelism":0,"id"'))
    job = Job("views").source(
        "clicks", fields={"page": "string", "ts": "timestamp"}, key="page", event_time="ts"
    )
    built = job.window(tumbling("5s")).aggregate(count()).set_parallelism(2).build()
    assert built.parallelism == 2
