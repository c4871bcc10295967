"""SIGKILL the processor while an operator job runs, start it again, and its results are exact.

The processor runs as the stack starts it (`python -m services.processor`) with a `running_total`
job from a spec file; the operator is found through its entry point, installed for the test. Events
keep arriving while the processor is killed (its process group: the driver, Spark's JVM and its
Python workers) and restarts from its checkpoint. Every key's newest result must equal the oracle,
and every result the replay wrote again must be the same result: the n-th result of a key (its
version's count) always carries the same total.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from infra.local import procs
from infra.local.stack import StackConfig, start_service, wait_service_ready
from infra.paths import ROOT
from services.processor.jobs.versions import split_version
from shared.jobspec import load_job_spec
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.kafka_util import produce_keyed, read_all
from tests.operators_util import install_operators, shipped_operators

pytestmark = [pytest.mark.e2e, pytest.mark.faults]
BASE = 1_767_225_600_000
SPEC = """
id: {id}
source:
  topic: {topic}
  fields: {{k: string, value: double, ts: timestamp}}
  key: [k]
  event_time: {{field: ts}}
watermark: {{max_out_of_orderness: 2s}}
process: {{operator: running_total, params: {{field: value}}}}
trigger_interval: 300ms
output_topic: {topic}.out
"""


def results(bootstrap: str, topic: str) -> list[WindowResult]:
    return [WindowResult.from_json(m.value()) for m in read_all(bootstrap, topic, timeout_s=15)]


def test_sigkill_mid_stream_then_restart_gives_exact_operator_results(
    stack_cfg: StackConfig, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(SPEC.format(id=f"{unique}-total", topic=unique))
    spec = load_job_spec(path)
    plugins = install_operators(tmp_path / "plugins", shipped_operators())
    cfg = dataclasses.replace(stack_cfg, job_specs=(path,))
    inherited = os.environ.get("PYTHONPATH", "")
    env = {
        "SF_DATA_DIR": str(tmp_path / "data"),
        "PYTHONPATH": ":".join(p for p in (str(ROOT), str(plugins), inherited) if p),
    }
    ensure_topics(kafka_bootstrap, [spec.source.valid_topic, spec.output_topic], partitions=2)
    events = [{"k": "abc"[i % 3], "value": float(i % 50) / 4, "ts": BASE + i * 20} for i in range(3_000)]
    chunks = [events[i : i + 100] for i in range(0, len(events), 100)]

    def produce(chunk: list[dict[str, object]]) -> None:
        produce_keyed(
            kafka_bootstrap, spec.source.valid_topic, ((str(e["k"]).encode(), orjson.dumps(e)) for e in chunk)
        )

    try:
        start_service(cfg, "processor", env)
        wait_service_ready(cfg, "processor", timeout_s=240)
        for chunk in chunks[:10]:
            produce(chunk)
            time.sleep(0.3)
        deadline = time.monotonic() + 180
        while not results(kafka_bootstrap, spec.output_topic) and time.monotonic() < deadline:
            time.sleep(1)
        feeder = threading.Thread(target=lambda: [produce(c) or time.sleep(0.2) for c in chunks[10:20]])
        feeder.start()
        time.sleep(1.0)
        pid = procs.pid_of("processor", cfg.run_dir)
        assert pid is not None
        killed_at = len(results(kafka_bootstrap, spec.output_topic))
        os.killpg(pid, signal.SIGKILL)
        assert procs._wait_gone(pid, 10), "the processor survived SIGKILL"
        feeder.join()
        start_service(cfg, "processor", env)
        wait_service_ready(cfg, "processor", timeout_s=240)
        for chunk in chunks[20:]:
            produce(chunk)

        counts = {k: sum(1 for e in events if e["k"] == k) for k in "abc"}
        totals = {k: math.fsum(float(str(e["value"])) for e in events if e["k"] == k) for k in "abc"}
        got: list[WindowResult] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            got = results(kafka_bootstrap, spec.output_topic)
            newest = {
                k: max((r for r in got if r.key == k), key=lambda r: r.version, default=None) for k in "abc"
            }
            if all(r is not None and r.aggregates["events"] == counts[r.key] for r in newest.values()):
                break
            time.sleep(2)
        assert 0 < killed_at < len(events), _log(cfg)
        by_count: dict[tuple[str, int], set[float]] = defaultdict(set)
        for r in got:
            by_count[(r.key, split_version(r.version)[1])].add(round(float(r.aggregates["total"] or 0), 6))
        # The n-th result of a key, written once or again by the replay, always says the same.
        assert all(len(totals_seen) == 1 for totals_seen in by_count.values())
        for k in "abc":
            assert {n for key, n in by_count if key == k} == set(range(1, counts[k] + 1)), _log(cfg)
            assert by_count[(k, counts[k])] == {round(totals[k], 6)}
    finally:
        procs.stop_process("processor", cfg.run_dir)


def _log(cfg: StackConfig) -> str:
    log = cfg.run_dir / "logs" / "processor.log"
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no log)"
