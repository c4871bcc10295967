"""SIGKILL the processor mid-stream, start it again, and the results are exact.

The processor runs as a real process (`python -m services.processor`, as the stack starts it) with
two jobs from spec files on one stream: a tumbling on_update job and a sliding on_window_close job.
Events keep arriving in the `.valid` topic (as ingest forwards them) while the processor is killed
(its whole process group: the Python driver and Spark's JVM) and while it restarts. The newest version
of every window on the output topic (what the sink keeps) must equal the plain-Python oracle: no event
lost, none counted twice, and a closed window replayed after the crash carries the same result.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from pathlib import Path

import orjson
import pytest

from infra.demo.datagen import oracle_sliding_values, oracle_window_counts
from infra.local import procs
from infra.local.stack import StackConfig, start_service, wait_service_ready
from shared.jobspec import load_job_spec
from shared.kafka import ensure_topics
from shared.records import WindowResult
from tests.kafka_util import produce_keyed, read_all

pytestmark = [pytest.mark.e2e, pytest.mark.faults]
BASE = 1_767_225_600_000
SPEC = """
id: {id}
source:
  topic: {topic}
  fields: {{k: string, value: double, ts: timestamp}}
  key: [k]
  event_time: {{field: ts}}
window: {window}
watermark: {{max_out_of_orderness: 2s}}
aggregations: [{{fn: count, as: n}}, {{fn: sum, field: value, as: total}}]
emit: {emit}
trigger_interval: 300ms
output_topic: {topic}.out
"""


def make_events(n: int, span_ms: int) -> list[dict[str, object]]:
    # In order except a small shuffle (under the 2 s watermark delay): nothing is late.
    out = []
    for i in range(n):
        ts = BASE + i * span_ms // n - (i % 7) * 130
        out.append({"k": "abc"[i % 3], "value": float(i % 50) / 4, "ts": ts})
    return out


def newest(bootstrap: str, topic: str) -> dict[str, dict[tuple[str, int], list[WindowResult]]]:
    by_job: dict[str, dict[tuple[str, int], list[WindowResult]]] = {}
    for m in read_all(bootstrap, topic, timeout_s=15):
        r = WindowResult.from_json(m.value())
        by_job.setdefault(r.job_id, {}).setdefault((r.key, r.window_start), []).append(r)
    return by_job


def test_sigkill_mid_stream_then_restart_gives_exact_results(
    stack_cfg: StackConfig, kafka_bootstrap: str, unique: str, tmp_path: Path
) -> None:
    specs = {
        "update": ("{type: tumbling, size: 2s}", "on_update"),
        "close": ("{type: sliding, size: 4s, slide: 2s}", "on_window_close"),
    }
    paths = []
    for name, (window, emit) in specs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(SPEC.format(id=f"{unique}-{name}", topic=unique, window=window, emit=emit))
        paths.append(path)
    tumbling, sliding = (load_job_spec(p) for p in paths)
    cfg = dataclasses.replace(stack_cfg, job_specs=tuple(paths))
    env = {"SF_DATA_DIR": str(tmp_path / "data")}  # its own checkpoints and job ledger
    ensure_topics(kafka_bootstrap, [tumbling.source.valid_topic, tumbling.output_topic], partitions=2)
    events = make_events(3_000, 60_000)
    chunks = [events[i : i + 100] for i in range(0, len(events), 100)]

    def produce(chunk: list[dict[str, object]]) -> None:
        produce_keyed(
            kafka_bootstrap,
            tumbling.source.valid_topic,
            ((str(e["k"]).encode(), orjson.dumps(e)) for e in chunk),
        )

    killed_at = 0
    try:
        start_service(cfg, "processor", env)
        wait_service_ready(cfg, "processor", timeout_s=180)
        for chunk in chunks[:10]:
            produce(chunk)
            time.sleep(0.3)
        # Results are flowing: kill the processor while more events arrive.
        deadline = time.monotonic() + 120
        while not newest(kafka_bootstrap, tumbling.output_topic) and time.monotonic() < deadline:
            time.sleep(1)
        feeder = threading.Thread(target=lambda: [produce(c) or time.sleep(0.2) for c in chunks[10:20]])
        feeder.start()
        time.sleep(1.0)
        pid = procs.pid_of("processor", cfg.run_dir)
        assert pid is not None
        killed_at = sum(
            len(rows)
            for job in newest(kafka_bootstrap, tumbling.output_topic).values()
            for rows in job.values()
        )
        os.killpg(pid, signal.SIGKILL)
        assert procs._wait_gone(pid, 10), "the processor survived SIGKILL"
        feeder.join()
        start_service(cfg, "processor", env)
        wait_service_ready(cfg, "processor", timeout_s=180)
        for chunk in chunks[20:]:
            produce(chunk)

        expected_update = oracle_window_counts(events, 2_000, key_field="k")
        expected_sums = {
            k: math.fsum(
                float(str(e["value"]))
                for e in events
                if (str(e["k"]), int(str(e["ts"])) - int(str(e["ts"])) % 2_000) == k
            )
            for k in expected_update
        }
        # Nothing is late (the shuffle stays under the delay): a sliding window closes, with all its
        # events, once the largest event time minus the delay passes its end.
        closes_by = max(int(str(e["ts"])) for e in events) - 2_000
        sliding_values = oracle_sliding_values(events, 4_000, 2_000, "k", "value")
        expected_close = {k: len(v) for k, v in sliding_values.items() if k[1] + 4_000 <= closes_by}
        got: dict[str, dict[tuple[str, int], list[WindowResult]]] = {}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            got = newest(kafka_bootstrap, tumbling.output_topic)
            latest_update = {
                k: max(rs, key=lambda r: r.version) for k, rs in got.get(tumbling.id, {}).items()
            }
            latest_close = {k: max(rs, key=lambda r: r.version) for k, rs in got.get(sliding.id, {}).items()}
            if {k: r.aggregates["n"] for k, r in latest_update.items()} == expected_update and {
                k: r.aggregates["n"] for k, r in latest_close.items()
            } == expected_close:
                break
            time.sleep(2)
        assert {k: r.aggregates["n"] for k, r in latest_update.items()} == expected_update, _log(cfg)
        assert {k: r.aggregates["n"] for k, r in latest_close.items()} == expected_close, _log(cfg)
        for k, r in latest_update.items():
            assert math.isclose(float(r.aggregates["total"] or 0), expected_sums[k], rel_tol=1e-9)
        # A closed window may be written again by the batch replayed after the crash: same version and
        # the same final numbers, never a different answer.
        for rows in got[sliding.id].values():
            assert all(r.final for r in rows)
            assert len({(r.aggregates["n"], r.aggregates["total"]) for r in rows}) == 1
        assert killed_at > 0
    finally:
        procs.stop_process("processor", cfg.run_dir)


def _log(cfg: StackConfig) -> str:
    log = cfg.run_dir / "logs" / "processor.log"
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else "(no log)"
