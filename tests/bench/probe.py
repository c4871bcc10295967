"""Where the time goes while a part runs: per-stage progress and CPU, sampled once a second.

- progress: each service's ``records_processed_total`` from its Prometheus /metrics (ingest: events
  forwarded to ``.valid``; processor: input rows of finished micro-batches; sink: window updates),
  as the increase since the probe started;
- CPU: user+system seconds of each process of the stack with its descendants (the processor's
  JVM is a child of its Python driver), read from /proc;
- the machine's busy CPU time (every process: other work on a shared machine shows here) and its
  1-minute load average.

From the samples: how many cores each process used on average over an interval, and when each
stage had done a given number of records. The stage that is busy (near 1 core for a single-threaded
Python service, near 2 for Spark on local[2]) while the others wait is the bottleneck.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from infra.local.stack import StackConfig
from tests.bench.stack import pids

_TICKS = os.sysconf("SC_CLK_TCK")
PROGRESS_METRIC = "records_processed_total"


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields after the command name; [0] is the state


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def cpu_seconds(processes: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each named pid and its live descendants (one scan of /proc)."""
    children = _children()
    out = {}
    for name, pid in processes.items():
        ticks, todo = 0, [pid]
        while todo:
            p = todo.pop()
            fields = _stat(p)
            if fields is not None:
                ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
            todo.extend(children.get(p, []))
        out[name] = round(ticks / _TICKS, 2)
    return out


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (every process, not only the stack's), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICKS


def records_processed(url: str) -> float | None:
    """Sum of records_processed_total over all label sets of one /metrics page (None if unreachable)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == PROGRESS_METRIC
    )


class StageProbe:
    def __init__(self, cfg: StackConfig, interval_s: float = 1.0) -> None:
        self.cfg = cfg
        self.interval_s = interval_s
        ingest, processor, sink = cfg.metrics_ports
        self.urls = {
            "ingest": f"http://127.0.0.1:{ingest}/metrics",
            "processor": f"http://127.0.0.1:{processor}/metrics",
            "sink": f"http://127.0.0.1:{sink}/metrics",
        }
        self.samples: list[dict[str, Any]] = []
        self._base: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stage-probe", daemon=True)
        self.t0 = time.perf_counter()

    def start(self, t0: float | None = None) -> StageProbe:
        self.t0 = t0 if t0 is not None else time.perf_counter()
        self._base = {k: v for k, v in self._progress().items() if v is not None}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> StageProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self.stop()

    def _progress(self) -> dict[str, float | None]:
        return {stage: records_processed(url) for stage, url in self.urls.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            with contextlib.suppress(Exception):  # a sample lost to a dying process is no failure
                sample: dict[str, Any] = {"t": round(started - self.t0, 2)}
                sample["cpu_s"] = cpu_seconds(pids(self.cfg))
                sample["cpu_s"]["machine"] = round(machine_busy_seconds(), 2)
                sample["records"] = {
                    stage: round(v - self._base.get(stage, 0.0))
                    for stage, v in self._progress().items()
                    if v is not None
                }
                sample["load_1m"] = round(os.getloadavg()[0], 2)
                self.samples.append(sample)
            self._stop.wait(max(0.05, self.interval_s - (time.perf_counter() - started)))

    # --- summaries ------------------------------------------------------------------------------------
    def cores(self, t_from: float = 0.0, t_to: float | None = None) -> dict[str, float]:
        """Average cores each process used between two sample times (seconds since t0)."""
        window = [s for s in self.samples if s["t"] >= t_from and (t_to is None or s["t"] <= t_to)]
        if len(window) < 2:
            return {}
        first, last = window[0], window[-1]
        span = last["t"] - first["t"]
        return {
            name: round((last["cpu_s"][name] - first["cpu_s"][name]) / span, 2)
            for name in last["cpu_s"]
            if name in first["cpu_s"] and span > 0
        }

    def reached(self, stage: str, records: int) -> float | None:
        """Seconds since t0 of the first sample where ``stage`` had done ``records`` (None: never)."""
        for s in self.samples:
            if s["records"].get(stage, 0) >= records:
                return float(s["t"])
        return None

    def load(self) -> dict[str, float]:
        loads = [s["load_1m"] for s in self.samples]
        if not loads:
            return {}
        return {"min": min(loads), "max": max(loads), "mean": round(sum(loads) / len(loads), 2)}
