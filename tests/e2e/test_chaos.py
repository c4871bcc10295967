"""`make chaos`, short: 105,000 records over three jobs while each service is SIGKILLed once.

The full run (`make chaos`: over a million records, three kills per service, a kill during a
savepoint, broker and Redis restarts) takes several minutes; this one is part of `make test`. The
verdict comes from tests/chaos/harness.py: every window in Redis equals an oracle computed from the
input alone (nothing lost, nothing extra, values exact), versions never went back, the dead-letter
topics hold exactly the injected bad records and the late topics exactly the late events.
"""

from __future__ import annotations

import pytest

from infra.local import procs
from tests.bench.stack import config_at, services_up
from tests.chaos.__main__ import RUN, SHIFT, SHORT, fresh_run_dir, print_report
from tests.chaos.harness import run

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


def test_each_service_killed_under_load_and_every_window_equals_the_oracle() -> None:
    fresh_run_dir()
    cfg = config_at(RUN, SHIFT)
    try:
        services_up(cfg, zipkin=False)
        report = run(cfg, SHORT, log=lambda _: None, settle_s=180)
    finally:
        procs.stop_all(RUN)
    print_report(report)
    assert [f["what"] for f in report["faults"]].count("processor") == 1
    assert not any(f["error"] for f in report["faults"]), report["faults"]
    for job in report["jobs"]:
        assert job["ok"], job
        assert job["dead_letters"][0] > 0 and job["late"][0] > 0  # the input exercised both
    assert report["version_reads"] > 10 and not report["version_regressions"]
    assert report["verdict"] == "PASS"
