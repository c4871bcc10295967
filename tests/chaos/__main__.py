"""`make chaos` / `python -m tests.chaos [--short]`: the platform under faults, one verdict.

The full run: 1,050,000 records over three jobs (tumbling, sliding, session) at 6,000/s, each of
ingest, processor, sink and control SIGKILLed three times, the processor once more during a
savepoint, the broker and Redis restarted once each. `--short`: 105,000 records, each service killed
once (what `make test` runs, tests/e2e/test_chaos.py). Exit status 1 on any mismatch. The report is
printed and written to .run/chaos[-<offset>]/report.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from infra.local import procs
from infra.paths import RUN_DIR
from tests.bench.stack import config_at, services_up
from tests.chaos.harness import Plan, run

OFFSET = int(os.environ.get("SF_TEST_PORT_OFFSET", "0"))
RUN = RUN_DIR / (f"chaos-{OFFSET}" if OFFSET else "chaos")
SHIFT = OFFSET + 140  # the test ports shifted past the benches' (+50..+70)

FULL = Plan(
    events_per_job=350_000,
    rate=6_000,
    kills_per_service=3,
    savepoint_kill=True,
    restart_broker=True,
    restart_redis=True,
)
SHORT = Plan(
    events_per_job=35_000,
    rate=3_000,
    kills_per_service=1,
    savepoint_kill=False,
    restart_broker=False,
    restart_redis=False,
)


def fresh_run_dir() -> None:
    """Nothing of an earlier run: its jobs live on in control's store (Redis's AOF) and checkpoints."""
    procs.stop_all(RUN)
    shutil.rmtree(RUN, ignore_errors=True)


def print_report(report: dict[str, object]) -> None:
    print(f"\n== chaos: {report['verdict']} ({report['events']:,} records, {report['seconds']} s)")
    print("faults (at s since the load began, recovered = until the component answered again):")
    for f in report["faults"]:  # type: ignore[attr-defined]
        print(f"  {f['at_s']:>7} s  {f['what']:<20} recovered in {f['recovered_s']} s {f['error']}")
    print(
        f"versions: read every window's about once a second ({report['version_reads']} rounds), "
        f"{len(report['version_regressions'])} went back"  # type: ignore[arg-type]
    )
    for j in report["jobs"]:  # type: ignore[attr-defined]
        print(
            f"  {j['kind']:<9} windows {j['windows_expected']:>6}  lost {j['lost']}  extra {j['extra']}  "
            f"wrong {j['wrong']}  dead letters {j['dead_letters'][1]}/{j['dead_letters'][0]}  "
            f"late {j['late'][1]}/{j['late'][0]} {'exact' if j['late_ids_match'] else 'DIFFERENT'}  "
            f"{'ok' if j['ok'] else 'FAIL ' + '; '.join(j['examples'])}"
        )


def main(argv: list[str]) -> int:
    plan = SHORT if "--short" in argv else FULL
    fresh_run_dir()
    cfg = config_at(RUN, SHIFT)
    try:
        services_up(cfg, zipkin=False)
        report = run(cfg, plan)
    finally:
        procs.stop_all(RUN)
    (RUN / "report.json").write_text(json.dumps(report, indent=2))
    print_report(report)
    return 0 if report["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
