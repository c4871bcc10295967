"""`make bench` / `python -m tests.bench [parts]`: the end-to-end report, or some of its parts.

    python -m tests.bench                    # every part of the report, then the report
    python -m tests.bench pipeline faust     # those parts only, then the report again
    python -m tests.bench report             # the report alone, from the parts' last results
    python -m tests.bench all                # the report's parts and the component benches below
    python -m tests.bench sink tracing       # component benches run by name as well
    python -m tests.bench --part ingest      # one part in this process (to profile it), no report

The report's parts (tests/bench/bench_<part>.py, in this order): kafka, ingest, spark, pipeline,
freshness, recovery, memory, silence, hdfs, hosts, faust, auth, operators. The component benches
(processor, sink, sink_faust, tracing, startup, wire, commits, checkpoints, cleanup) measure one piece
each, on their own broker where they need one, and are not in the report.

Each part runs in its own Python process (a part's SparkSession, JVM or faust event loop ends with
it) and writes .run/bench/<part>.json; a part that fails writes its error there and the others still
run. The report parts share one stack (tests/bench/stack.py): its run dir is cleared before the
first part and everything in it is stopped after the last. The report (.run/bench/report.json,
report.md, report.png) is built from the newest result of every part. The committed results file,
tests/bench/RESULTS.md, is rewritten when every report part has just run or ``report`` is asked for,
not after a subset of parts. ``--part NAME`` runs one part in the calling process (what a profiler
wraps) and stops the stack it started once that part is done.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / ".run" / "bench"
RESULTS = HERE / "RESULTS.md"
REPORT_PARTS = (
    "kafka",
    "ingest",
    "spark",
    "pipeline",
    "freshness",
    "recovery",
    "memory",
    "silence",
    "hdfs",
    "hosts",
    "faust",
    "auth",
    "operators",
)
COMPONENT_BENCHES = (
    "processor",
    "sink",
    "sink_faust",
    "tracing",
    "startup",
    "wire",
    "commits",
    "checkpoints",
    "cleanup",
)
# What run_parts adds to its ``--part`` children: the stack is shared with the next part, and run_parts
# stops it after the last.
SHARED_STACK = "--shared-stack"


def run_part(name: str) -> int:
    """Run one part in this process and write its result (or its error) to .run/bench/<name>.json."""
    from tests.bench.report import git_commit

    OUT.mkdir(parents=True, exist_ok=True)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    result: dict[str, Any]
    code = 0
    try:
        module = importlib.import_module(f"tests.bench.bench_{name}")
        result = dict(module.main())
    except Exception as e:
        traceback.print_exc()
        result, code = {"error": f"{type(e).__name__}: {e}"}, 1
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["load_average_1m"] = {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)}
    result["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    result["commit"] = git_commit()
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(f"== bench {name} ({result['wall_s']} s)")
    for k, v in result.items():
        text = json.dumps(v) if isinstance(v, dict | list) else str(v)
        print(f"   {k}: {text if len(text) < 400 else text[:400] + ' ...'}")
    return code


def main(argv: list[str]) -> int:
    if argv[:1] == ["--part"] and len(argv) in (2, 3):
        name, shared = argv[1], argv[2:] == [SHARED_STACK]
        try:
            return run_part(name)
        finally:
            if name in REPORT_PARTS and not shared:  # run alone: nothing else stops what it started
                stop_stack()
    names = list(argv) or list(REPORT_PARTS)
    if names == ["all"]:
        names = [*REPORT_PARTS, *COMPONENT_BENCHES]
    unknown = [n for n in names if n != "report" and not (HERE / f"bench_{n}.py").exists()]
    if unknown:
        print(f"unknown part(s) {unknown}; parts: {', '.join(REPORT_PARTS + COMPONENT_BENCHES)}, report")
        return 2
    parts = [n for n in names if n != "report"]
    failed = run_parts(parts) if parts else []
    if set(names) & {"report", *REPORT_PARTS}:
        from tests.bench.report import write_report

        full = "report" in names or set(REPORT_PARTS) <= set(parts)
        print(write_report(OUT, REPORT_PARTS, RESULTS if full else None))
        if full:
            print(f"== wrote {RESULTS.relative_to(HERE.parents[1])}")
        else:
            print(f"== {RESULTS.name} not rewritten after some parts: `python -m tests.bench report` does it")
    if failed:
        print(f"failed: {', '.join(failed)} (see .run/bench/<part>.json and the logs in the run dir)")
    return 1 if failed else 0


def stop_stack(clear: bool = False) -> None:
    """Stop every process of the report parts' stack (tests/bench/stack.py); ``clear``: its run dir too."""
    from infra.local import procs
    from tests.bench.stack import RUN

    procs.stop_all(RUN)
    if clear:
        shutil.rmtree(RUN, ignore_errors=True)


def run_parts(parts: list[str]) -> list[str]:
    started = time.monotonic()
    shared = [p for p in parts if p in REPORT_PARTS]
    if shared:  # a fresh stack for the report's parts: nothing left from an earlier run
        stop_stack(clear=True)
    failed = []
    try:
        for name in parts:
            code = subprocess.run(
                [sys.executable, "-m", "tests.bench", "--part", name, SHARED_STACK], check=False
            ).returncode
            if code != 0:
                failed.append(name)
    finally:
        if shared:
            stop_stack()
    print(f"== {len(parts)} part(s) in {time.monotonic() - started:.0f} s")
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
