"""shared/watchdog.py: a guarded call that overruns its deadline restarts the process in place; so does
ingest on a fatal Kafka client error that is not a fence."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, Message
from opentelemetry import trace
from pydantic import ValidationError

from services.ingest.__main__ import IngestService
from services.ingest.consumer import Ingest
from services.ingest.errors import FatalKafkaError
from services.ingest.settings import IngestSettings
from shared.watchdog import CALM_S, CallWatchdog, restart_backoff_s

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
        IngestSettings(tuning_overrides={"stuck_call_restart_s": 10})
    assert IngestSettings(tuning_overrides={"stuck_call_restart_s": 0}).tuning.stuck_call_restart_s == 0
    assert IngestSettings().tuning.stuck_call_restart_s == 60


def test_restarts_in_a_row_back_off_and_a_calm_run_starts_over() -> None:
    assert restart_backoff_s(0, 10.0) == (1, 0.0)
    assert [restart_backoff_s(n, 10.0)[1] for n in range(1, 5)] == [1.0, 3.0, 7.0, 15.0]
    assert restart_backoff_s(20, 10.0) == (21, 60.0)  # capped
    assert restart_backoff_s(20, CALM_S + 1) == (1, 0.0)  # ran a while since: a new problem


class FailingIngest:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def run(self) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("code", "restart_on_fatal", "restarted"),
    [
        (KafkaError.INVALID_TXN_STATE, True, True),  # broken client: a fresh one fences it
        (KafkaError.PRODUCER_FENCED, True, False),  # a newer incarnation runs: leave it be
        (KafkaError.FENCED_INSTANCE_ID, True, False),
        (KafkaError.INVALID_TXN_STATE, False, False),  # exit 3, for a supervisor to restart
    ],
)
def test_ingest_restarts_in_place_on_a_fatal_client_error_unless_fenced(
    code: int, restart_on_fatal: bool, restarted: bool
) -> None:
    error = FatalKafkaError("unrecoverable transaction error", KafkaError(code, "x", fatal=True))
    restarts: list[bool] = []
    service = IngestService(
        FailingIngest(error),  # type: ignore[arg-type]
        IngestSettings(tuning_overrides={"restart_on_fatal": restart_on_fatal}),
        trace.get_tracer("test"),
        restart=lambda: restarts.append(True),
    )
    if restarted:
        service.run()
        assert restarts == [True]
    else:
        with pytest.raises(FatalKafkaError):
            service.run()
        assert restarts == []


class RevokingFatalConsumer:
    """A consumer that fails fatally (a fenced static member) and revokes the partitions in the same
    poll, as librdkafka does: the revocation callback runs inside consume()."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        self.ingest._rebalances += 1  # what the revocation callback does
        fenced = KafkaError(KafkaError._FATAL, "Static consumer fenced by other consumer", fatal=True)
        return [Message(error=fenced)]


def test_a_fatal_consumer_error_is_raised_even_from_a_batch_a_rebalance_drops() -> None:
    ingest = Ingest(IngestSettings(grpc_port=1), [])
    ingest._consumer = RevokingFatalConsumer(ingest)  # type: ignore[assignment]
    ingest._pipeline = object()  # type: ignore[assignment]
    with pytest.raises(FatalKafkaError, match="fenced"):
        ingest.run_once()
