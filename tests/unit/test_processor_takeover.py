"""A processor that comes back to find its jobs held by another waits before it starts Spark
(services/processor/service.py, Processor._yield_to_takeover), so the other catches up on the cores."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from services.processor.jobs import savepoints
from services.processor.jobs.leases import CheckpointLease
from services.processor.jobs.ledger import JobLedger, LedgerEntry
from services.processor.jobs.recovery import resume_holders, resume_verdicts
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.table import HostedJob
from services.processor.metrics import JobMetricsListener
from services.processor.service import Processor, warmup_seconds
from services.processor.settings import ProcessorSettings
from shared.jobstate import JobState
from tests.unit.test_processor_savepoints import SPEC


def processor_with_jobs(tmp_path: Path, delay_s: float, **should_run: bool) -> Processor:
    settings = ProcessorSettings(data_dir=str(tmp_path), tuning_overrides={"taken_over_delay_s": delay_s})
    store = JobLedger(settings.jobs_path)
    for job_id, run in should_run.items():
        store.put(LedgerEntry(spec=SPEC.model_copy(update={"id": job_id}), should_run=run, epoch=0))
    return Processor(settings, [], [])


def hold(p: Processor, job_id: str) -> CheckpointLease:
    lease = CheckpointLease(p.settings.checkpoints_path / job_id)  # another open file: another holder
    lease.acquire()
    return lease


def timed(p: Processor, yielded: bool | None = None) -> float:
    began = time.monotonic()
    result = p._yield_to_takeover()
    if yielded is not None:
        assert result is yielded
    return time.monotonic() - began


def test_stored_leases_name_the_holders_of_the_jobs_a_start_resumes(tmp_path: Path) -> None:
    p = processor_with_jobs(tmp_path, 30, a=True, b=True, stopped=False)
    held = hold(p, "a")
    leases = resume_holders(p.settings)
    assert set(leases) == {"a", "b"}  # a stopped job is not resumed
    assert leases["a"] is not None and leases["a"].startswith("pid ")
    assert leases["b"] is None
    held.release()


def test_a_job_stopped_where_it_ran_is_not_one_a_start_resumes(tmp_path: Path) -> None:
    p = processor_with_jobs(tmp_path, 0.5, a=True, b=True)
    held = hold(p, "a")
    checkpoint = p.settings.checkpoints_path / "b"
    savepoints.write_note(checkpoint, "b", 0, "rows", trace="numbers")
    assert not savepoints.was_stopped(checkpoint)
    assert timed(p, yielded=False) < 0.5  # b is free to resume: no wait
    savepoints.mark_stopped(checkpoint)  # then cancelled on the processor it had moved to
    leases = resume_holders(p.settings)
    assert set(leases) == {"a"} and leases["a"] is not None
    assert timed(p, yielded=True) >= 0.5  # every job it would resume is held: it waits, then warms up
    held.release()


def test_a_quarantined_job_is_not_one_a_start_resumes(tmp_path: Path) -> None:
    p = processor_with_jobs(tmp_path, 0.5, a=True, stopped=False)
    crashes = p.settings.tuning.job_quarantine_crashes
    JobLedger(p.settings.jobs_path).put(
        LedgerEntry(spec=SPEC.model_copy(update={"id": "q"}), should_run=True, epoch=0, crashes=crashes)
    )
    held = hold(p, "a")
    verdicts = {v.entry.spec.id: v.verdict for v in resume_verdicts(p.settings)}
    assert verdicts == {"a": "held", "q": "quarantined"}  # a job that should not run has none
    assert set(resume_holders(p.settings)) == {"a"}
    assert timed(p, yielded=True) >= 0.5  # q will be FAILED, not run: every job it would resume is held
    held.release()
    verdicts = {v.entry.spec.id: v.verdict for v in resume_verdicts(p.settings)}
    assert verdicts == {"a": "resume", "q": "quarantined"}


class _DeadQuery:
    """A streaming query that stopped with an error (what supervise() reads of it)."""

    isActive = False

    def exception(self) -> Exception:
        return RuntimeError("org.apache.spark.SparkException: Job aborted\nat ...")


def test_a_job_the_processor_gave_up_on_is_not_one_a_start_resumes(tmp_path: Path) -> None:
    """Control decides whether it runs again, and where; resumed by this processor's next start, it
    would run beside a job control may have failed for good."""
    settings = ProcessorSettings(
        data_dir=str(tmp_path), tuning_overrides={"job_restart_attempts": 1, "job_restart_backoff_ms": 0}
    )
    manager = JobRunner(None, settings, JobMetricsListener(None))  # type: ignore[arg-type]  # no Spark needed
    dead: Any = _DeadQuery()
    for job_id in ("a", "b"):
        spec = SPEC.model_copy(update={"id": job_id})
        manager.ledger.put(LedgerEntry(spec=spec, should_run=True, epoch=0))
        manager._set(
            HostedJob(spec=spec, epoch=0, state=JobState.RUNNING, query=dead, running_since=time.monotonic())
        )
    manager._set(manager.table.get("b"), query=None)  # b runs on

    manager.supervise()  # the first failure: a's restart is due at once
    assert manager.get("a").state == JobState.FAILING
    assert {v.entry.spec.id for v in resume_verdicts(settings)} == {"a", "b"}  # it restarts the job itself
    manager._set(manager.table.get("a"), state=JobState.RUNNING, query=dead)  # restarted, died again
    manager.supervise()

    failed = manager.get("a")
    assert (
        failed.state == JobState.FAILED and failed.message == "org.apache.spark.SparkException: Job aborted"
    )
    stored = manager.ledger.get("a")
    assert stored is not None and not stored.should_run
    assert {v.entry.spec.id for v in resume_verdicts(settings)} == {"b"}


def test_it_waits_while_every_job_it_ran_is_held_elsewhere(tmp_path: Path) -> None:
    p = processor_with_jobs(tmp_path, 1.5, a=True, b=True)
    leases = [hold(p, "a"), hold(p, "b")]
    assert timed(p, yielded=True) >= 1.5
    for lease in leases:
        lease.release()


def test_it_starts_at_once_when_a_held_job_is_free_again(tmp_path: Path) -> None:
    p = processor_with_jobs(tmp_path, 120, a=True)
    lease = hold(p, "a")
    threading.Timer(0.5, lease.release).start()  # the processor that took it over died
    assert 0.5 <= timed(p, yielded=True) < 60


def test_it_does_not_wait_with_a_job_to_resume_no_job_or_no_delay(tmp_path: Path) -> None:
    one_free = processor_with_jobs(tmp_path / "one-free", 120, a=True, b=True)
    held = hold(one_free, "a")
    assert timed(one_free, yielded=False) < 60
    held.release()
    assert timed(processor_with_jobs(tmp_path / "none", 120), yielded=False) < 60
    no_delay = processor_with_jobs(tmp_path / "no-delay", 0, a=True)
    held = hold(no_delay, "a")
    assert timed(no_delay, yielded=True) < 60  # no wait, but its jobs are elsewhere all the same
    held.release()


def test_a_stop_ends_the_wait(tmp_path: Path) -> None:
    p = processor_with_jobs(tmp_path, 120, a=True)
    lease = hold(p, "a")
    threading.Timer(0.5, p.stop).start()  # SIGTERM while it waits
    assert timed(p) < 60
    lease.release()


def test_a_processor_whose_jobs_were_taken_over_warms_up_as_a_standby() -> None:
    main = ProcessorSettings()  # the stack's main processor: no warm-up at a first start
    assert warmup_seconds(main, yielded=False) == 0
    assert warmup_seconds(main, yielded=True) == main.tuning.taken_over_warmup_s == 30
    standby = ProcessorSettings(warmup_s=45)
    assert warmup_seconds(standby, yielded=False) == warmup_seconds(standby, yielded=True) == 45
    off = ProcessorSettings(tuning_overrides={"taken_over_warmup_s": 0})
    assert warmup_seconds(off, yielded=True) == 0
