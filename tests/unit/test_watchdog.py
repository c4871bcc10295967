"""shared/watchdog.py: a guarded call that overruns its deadline restarts the process in place."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.ingest.settings import IngestSettings
from shared.watchdog import CallWatchdog

ROOT = Path(__file__).resolve().parents[2]


def test_a_call_past_its_deadline_is_reported_once_with_what_it_was() -> None:
    stuck: list[tuple[str, float]] = []
    fired = threading.Event()

    def on_stuck(what: str, blocked_s: float) -> None:
        stuck.append((what, blocked_s))
        fired.set()

    dog = CallWatchdog(0.3, on_stuck, check_every_s=0.05)
    with dog.guard("send_offsets_to_transaction"):
        assert fired.wait(5)
    time.sleep(0.3)  # it fires once, then stops watching
    ((what, blocked_s),) = stuck
    assert what == "send_offsets_to_transaction" and blocked_s > 0.3


def test_calls_that_return_in_time_never_fire() -> None:
    stuck: list[tuple[str, float]] = []
    dog = CallWatchdog(0.5, lambda what, s: stuck.append((what, s)), check_every_s=0.05)
    try:
        for _ in range(8):  # together longer than the limit: only one call's time counts
            with dog.guard("commit_transaction"):
                time.sleep(0.1)
        time.sleep(0.6)  # and nothing counts between calls
        assert stuck == []
    finally:
        dog.stop()


SCRIPT = """
import os, sys, time
from shared.watchdog import CallWatchdog
if os.environ.get("SF_WATCHDOG_TEST_RUN") == "2":
    print("second run", os.getpid(), flush=True)
    sys.exit(0)
print("first run", os.getpid(), flush=True)
os.environ["SF_WATCHDOG_TEST_RUN"] = "2"
dog = CallWatchdog(0.3, check_every_s=0.05)
with dog.guard("a call that never returns"):
    time.sleep(60)
print("not reached", flush=True)
"""


def test_the_default_action_re_executes_the_process_with_the_same_pid(tmp_path: Path) -> None:
    """What production gets: the same command line again, in the same process (os.execv)."""
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0::3] == ["first", "second"] and "not reached" not in done.stdout
    first_pid, second_pid = lines[2], lines[5]
    assert first_pid == second_pid  # pid files and supervisors keep tracking it
    assert "has not returned after" in done.stderr and "a call that never returns" in done.stderr


def test_ingest_refuses_a_watchdog_shorter_than_the_calls_own_timeout() -> None:
    with pytest.raises(ValidationError, match="at least 35"):
        IngestSettings(stuck_call_restart_s=10)
    assert IngestSettings(stuck_call_restart_s=0).stuck_call_restart_s == 0
    assert IngestSettings().stuck_call_restart_s == 60
