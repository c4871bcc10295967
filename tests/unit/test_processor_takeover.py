"""Takeovers on a shared state root, without Spark: the epoch directories' fence (one winner per
rename or creation, ghosts never live), the ledger's verdicts, and the wait of a processor that comes
back to find its jobs taken over (services/processor/service.py, Processor._yield_to_takeover)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from services.processor.jobs.ledger import LedgerEntry
from services.processor.jobs.recovery import job_checkpoints, ledger_of, resume_verdicts
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.table import HostedJob
from services.processor.metrics import JobMetricsListener
from services.processor.service import Processor, all_moved, warmup_seconds
from services.processor.settings import ProcessorSettings
from services.processor.state import checkpoints as ckpt
from services.processor.state.checkpoints import JobCheckpoints
from services.processor.state.storage import LocalStorage
from shared.jobstate import JobState
from tests.unit.test_processor_savepoints import SPEC

STORAGE = LocalStorage()


def settings_on(root: Path, name: str, **tuning: Any) -> ProcessorSettings:
    return ProcessorSettings(
        data_dir=str(root / name), state_root=str(root / "state"), name=name, tuning_overrides=tuning
    )


def ran(settings: ProcessorSettings, job_id: str, epoch: int = 0, should_run: bool = True) -> JobCheckpoints:
    """What a processor leaves of a job it ran: a ledger entry and the job's live checkpoint."""
    ledger_of(settings, STORAGE).put(
        LedgerEntry(spec=SPEC.model_copy(update={"id": job_id}), should_run=should_run, epoch=epoch)
    )
    job = job_checkpoints(settings, STORAGE, job_id)
    if job.live() is None:
        assert job.claim(epoch, ckpt.note_for(job_id, epoch, "rows", "numbers"))
    return job


def taken_over(job: JobCheckpoints) -> int:
    """Another processor takes the job over, as JobRunner._prepare_checkpoint does."""
    live = job.live()
    assert live is not None and job.take_over(live, max(job.epochs()) + 1)
    return live + 1


def test_one_start_wins_the_creation_and_one_takeover_the_rename(tmp_path: Path) -> None:
    job = JobCheckpoints(STORAGE, (tmp_path / "job").as_uri())
    assert job.live() is None and job.epochs() == []
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        results.append(job.claim(0, {"epoch": 0}))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True] and job.live() == 0

    results.clear()
    barrier = threading.Barrier(8)

    def take(target: int) -> None:
        barrier.wait()
        results.append(job.take_over(0, target))

    threads = [threading.Thread(target=take, args=(1 + i % 2,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]  # the second finds its source gone
    live = job.live()
    assert live in (1, 2) and not job.is_live(0)


def test_a_ghost_of_the_old_owner_is_never_live(tmp_path: Path) -> None:
    """After the rename, the old owner's writes recreate ``epoch-E`` (Spark creates parents), even
    its note when it marks the job stopped: the live checkpoint stays the higher epoch's."""
    job = JobCheckpoints(STORAGE, (tmp_path / "job").as_uri())
    assert job.claim(3, ckpt.note_for("j", 3, "rows", "numbers"))
    assert job.is_live(3)
    assert job.take_over(3, 4)
    ghost = tmp_path / "job" / "epoch-3"
    (ghost / "commits").mkdir(parents=True)
    (ghost / "commits" / "7").write_text("v1")
    assert job.live() == 4 and not job.is_live(3) and job.is_live(4)
    ckpt.write_note(STORAGE, job.epoch_dir(3), ckpt.note_for("j", 3, "rows", "numbers"))  # even a note
    assert job.live() == 4 and not job.is_live(3)
    assert job.epochs() == [3, 4]  # the ghost's epoch still counts: no later start reuses it


def test_verdicts_name_the_jobs_taken_over_stopped_and_quarantined(tmp_path: Path) -> None:
    a = settings_on(tmp_path, "a")
    ran(a, "own")
    ran(a, "fresh-gone")  # its checkpoint removed by an operator: it starts afresh
    job = ran(a, "moved")
    taken_over(job)
    stopped = ran(a, "stopped")
    ckpt.mark_stopped(STORAGE, stopped.epoch_dir(0))
    ran(a, "not-to-run", should_run=False)
    crashes = a.tuning.job_quarantine_crashes
    ledger_of(a, STORAGE).put(
        LedgerEntry(spec=SPEC.model_copy(update={"id": "q"}), should_run=True, epoch=0, crashes=crashes)
    )
    STORAGE.delete(job_checkpoints(a, STORAGE, "fresh-gone").job_dir)
    verdicts = {v.entry.spec.id: (v.verdict, v.live_epoch) for v in resume_verdicts(a, STORAGE)}
    assert verdicts == {
        "own": ("resume", 0),
        "fresh-gone": ("resume", None),
        "moved": ("moved", 1),
        "stopped": ("stopped", 0),
        "q": ("quarantined", None),
    }
    # The other processor's ledger is its own: it names the epoch it took over.
    b = settings_on(tmp_path, "b")
    assert a.ledger_uri != b.ledger_uri and resume_verdicts(b, STORAGE) == []


class _DeadQuery:
    """A streaming query that stopped with an error (what supervise() reads of it)."""

    isActive = False

    def exception(self) -> Exception:
        return RuntimeError("org.apache.spark.SparkException: Job aborted\nat ...")


def test_a_job_the_processor_gave_up_on_is_not_one_a_start_resumes(tmp_path: Path) -> None:
    """Control decides whether it runs again, and where; resumed by this processor's next start, it
    would run beside a job control may have failed for good."""
    settings = settings_on(tmp_path, "p", job_restart_attempts=1, job_restart_backoff_ms=0)
    manager = JobRunner(None, settings, JobMetricsListener(None))  # type: ignore[arg-type]  # no Spark needed
    dead: Any = _DeadQuery()
    for job_id in ("a", "b"):
        spec = SPEC.model_copy(update={"id": job_id})
        ran(settings, job_id)
        manager._set(
            HostedJob(spec=spec, epoch=0, state=JobState.RUNNING, query=dead, running_since=time.monotonic())
        )
    manager._set(manager.table.get("b"), query=None)  # b runs on

    manager.supervise()  # the first failure: a's restart is due at once
    assert manager.get("a").state == JobState.FAILING
    assert {v.entry.spec.id for v in resume_verdicts(settings, STORAGE)} == {"a", "b"}
    manager._set(manager.table.get("a"), state=JobState.RUNNING, query=dead)  # restarted, died again
    manager.supervise()

    failed = manager.get("a")
    assert (
        failed.state == JobState.FAILED and failed.message == "org.apache.spark.SparkException: Job aborted"
    )
    stored = manager.ledger.get("a")
    assert stored is not None and not stored.should_run
    assert {v.entry.spec.id for v in resume_verdicts(settings, STORAGE)} == {"b"}


class _RunningQuery:
    """A query that runs (what fence() and _stop_running() read of it)."""

    isActive = True
    status = {"isTriggerActive": False}
    runId = "run-1"
    stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_a_running_job_whose_checkpoint_was_taken_over_stops_and_leaves_the_ledger(tmp_path: Path) -> None:
    settings = settings_on(tmp_path, "a")
    manager = JobRunner(None, settings, JobMetricsListener(None))  # type: ignore[arg-type]
    manager.spark = _NoTasks()  # type: ignore[assignment]
    query: Any = _RunningQuery()
    job = ran(settings, "j")
    spec = SPEC.model_copy(update={"id": "j"})
    manager._set(HostedJob(spec=spec, epoch=0, state=JobState.RUNNING, query=query))
    assert manager.fence() == [] and not query.stopped  # still its own
    taken_over(job)
    assert manager.fence() == ["j"] and query.stopped
    assert manager.list() == []  # no longer reported: control follows the processor that runs it
    entry = manager.ledger.get("j")
    assert entry is not None and not entry.should_run


class _NoTasks:
    """Enough of a SparkSession for await_tasks: a stopped SparkContext, which runs no task."""

    class sparkContext:
        _jsc = None


def timed(p: Processor, yielded: bool | None = None) -> float:
    began = time.monotonic()
    result = p._yield_to_takeover(STORAGE)
    if yielded is not None:
        assert result is yielded
    return time.monotonic() - began


def test_it_waits_when_every_job_it_ran_was_taken_over(tmp_path: Path) -> None:
    settings = settings_on(tmp_path, "a", taken_over_delay_s=1.0)
    p = Processor(settings, [], [])
    taken_over(ran(settings, "x"))
    taken_over(ran(settings, "y"))
    assert all_moved(settings, STORAGE)
    assert timed(p, yielded=True) >= 1.0


def test_it_does_not_wait_with_a_job_to_resume_no_job_or_no_delay(tmp_path: Path) -> None:
    one_free = settings_on(tmp_path / "1", "a", taken_over_delay_s=120)
    taken_over(ran(one_free, "x"))
    ran(one_free, "y")
    assert timed(Processor(one_free, [], []), yielded=False) < 60
    assert (
        timed(Processor(settings_on(tmp_path / "2", "a", taken_over_delay_s=120), [], []), yielded=False) < 60
    )
    no_delay = settings_on(tmp_path / "3", "a", taken_over_delay_s=0)
    taken_over(ran(no_delay, "x"))
    assert timed(Processor(no_delay, [], []), yielded=True) < 60  # no wait, but its jobs are elsewhere


def test_a_stop_ends_the_wait(tmp_path: Path) -> None:
    settings = settings_on(tmp_path, "a", taken_over_delay_s=120)
    taken_over(ran(settings, "x"))
    p = Processor(settings, [], [])
    threading.Timer(0.5, p.stop).start()  # SIGTERM while it waits
    assert timed(p) < 60


def test_a_processor_whose_jobs_were_taken_over_warms_up_as_a_standby() -> None:
    main = ProcessorSettings()  # the stack's main processor: no warm-up at a first start
    assert warmup_seconds(main, yielded=False) == 0
    assert warmup_seconds(main, yielded=True) == main.tuning.taken_over_warmup_s == 30
    standby = ProcessorSettings(warmup_s=45)
    assert warmup_seconds(standby, yielded=False) == warmup_seconds(standby, yielded=True) == 45
    off = ProcessorSettings(tuning_overrides={"taken_over_warmup_s": 0})
    assert warmup_seconds(off, yielded=True) == 0
