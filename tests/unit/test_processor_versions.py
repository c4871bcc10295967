"""Result versions and epochs: strictly growing per window across restarts and savepoint restores."""

from __future__ import annotations

import pytest

from services.processor.errors import ProcessorError
from services.processor.jobs.recovery import next_epoch
from services.processor.jobs.versions import MAX_BATCH_ID, MAX_EPOCH, split_version, version_of


def test_a_later_epoch_beats_every_batch_of_an_earlier_one() -> None:
    assert version_of(0, 7) == 7  # epoch 0: the batch id, as the first processor wrote it
    assert version_of(1, 0) > version_of(0, MAX_BATCH_ID)
    assert split_version(version_of(5, 123)) == (5, 123)
    assert version_of(MAX_EPOCH, MAX_BATCH_ID) < 2**53  # exact in JSON readers and Redis's Lua doubles


@pytest.mark.parametrize(("epoch", "batch"), [(-1, 0), (MAX_EPOCH + 1, 0), (0, -1), (0, MAX_BATCH_ID + 1)])
def test_out_of_range_is_refused(epoch: int, batch: int) -> None:
    with pytest.raises(ProcessorError):
        version_of(epoch, batch)


def test_epochs() -> None:
    assert next_epoch([], resumes_checkpoint=False, savepoint_epoch=None) == 0  # a new job id
    assert next_epoch([3], resumes_checkpoint=True, savepoint_epoch=None) == 3  # restart after a crash
    assert next_epoch([3, 2], resumes_checkpoint=False, savepoint_epoch=None) == 4  # checkpoint gone
    # Restores: above the savepoint's epoch and above anything the job id used since.
    assert next_epoch([], resumes_checkpoint=False, savepoint_epoch=0) == 1  # under a new job id
    assert next_epoch([4], resumes_checkpoint=False, savepoint_epoch=1) == 5  # an older savepoint
    assert next_epoch([1], resumes_checkpoint=False, savepoint_epoch=6) == 7


def test_versions_grow_through_a_story_of_restarts_and_restores() -> None:
    """A job's life: run, crash and resume, savepoint, restore an older savepoint twice."""
    emitted: list[int] = []
    epoch = next_epoch([], False, None)
    emitted += [version_of(epoch, b) for b in range(0, 10)]
    epoch = next_epoch([epoch], True, None)  # crash: batches 8 and 9 replayed, then more
    emitted += [version_of(epoch, b) for b in range(8, 20)]
    savepoint_epoch, savepoint_batch = epoch, 5  # an old savepoint taken at batch 5
    for _ in range(2):
        epoch = next_epoch([epoch], False, savepoint_epoch)
        emitted += [version_of(epoch, b) for b in range(savepoint_batch + 1, savepoint_batch + 4)]
    # Every version either repeats one already emitted (a replayed batch: the sink ignores it) or is
    # above all of them; the only repeats are the two batches replayed after the crash.
    repeats = []
    for i, v in enumerate(emitted):
        if v in emitted[:i]:
            repeats.append(v)
        else:
            assert v > max(emitted[:i], default=-1), (i, v)
    assert repeats == [version_of(0, 8), version_of(0, 9)]
