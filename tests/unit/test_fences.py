"""Fences: which window updates a partition's fences drop, and the record's wire form."""

from __future__ import annotations

import pytest

from shared.fences import Fence, PartitionFences, epoch_of, fence_of, fence_record


def test_an_update_is_stale_only_after_a_newer_epochs_fence_in_its_partition() -> None:
    fences = PartitionFences()
    assert fences.add(Fence("j", 2), offset=10)
    assert fences.stale_by("j", 1, 9) is None  # before the fence: written while epoch 1 held the job
    assert fences.stale_by("j", 1, 11) == (2, 10)
    assert fences.stale_by("j", 2, 11) is None
    assert fences.stale_by("other", 0, 11) is None  # a fence is per job
    assert fences.add(Fence("j", 5), offset=20)
    assert fences.stale_by("j", 2, 15) is None
    assert fences.stale_by("j", 4, 21) == (5, 20)
    assert fences.stale_by("j", 1, 15) == (2, 10)


def test_a_fence_read_again_or_not_newer_adds_nothing_and_survives_its_json() -> None:
    fences = PartitionFences()
    assert fences.add(Fence("j", 2), 10)
    assert not fences.add(Fence("j", 2), 10)  # a replay reads it again
    assert not fences.add(Fence("j", 1), 30)  # an older epoch's fence never lowers the bar
    assert PartitionFences.from_json(fences.to_json()) == fences
    with pytest.raises(ValueError):
        PartitionFences.from_json(b'{"j": [[1]]}')


def test_the_fence_record_round_trips_and_other_records_are_not_fences() -> None:
    _, _, headers = fence_record("job-1", 7)
    assert fence_of(headers) == Fence("job-1", 7)
    assert fence_of(None) is None
    assert fence_of([("traceparent", b"00-ab")]) is None
    with pytest.raises(ValueError):
        fence_of([("sf.fence.epoch", b"7")])
    assert epoch_of((7 << 32) + 123) == 7
