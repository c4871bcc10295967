"""Recovery after a host is lost, with a standby processor on another host.

`python -m tests.bench hosts` (root: hosts are network namespaces). The topology of
infra/hosts/topology.py, the chaos run of tests/hosts/test_hosts_faults.py (three jobs under load,
judged by the oracle) with one fault: every process of the active processor's host SIGKILLed. What
it reports: seconds from the kill until control has every job RUNNING on the standby, and until each
job's results move in Redis again ("fresh again"), and whether every window ended exact.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from infra.hosts import net
from infra.hosts import topology as hosts
from infra.local.stack import StackConfig
from tests.bench.stack import Control
from tests.chaos.harness import Faults, Plan, run
from tests.hosts.test_hosts_faults import PLAN, SERVICE_ENV, HostFaults


def _log(msg: str) -> None:
    print(f"[bench hosts] {msg}", flush=True)


def main() -> dict[str, Any]:
    if os.geteuid() != 0:
        raise RuntimeError("hosts are network namespaces: run as root")
    net.destroy()
    shutil.rmtree(hosts.config().run_dir, ignore_errors=True)
    cfg = hosts.config(service_env=SERVICE_ENV)
    hosts.up(cfg, _log, standby=False)
    made: list[HostFaults] = []

    def one_fault(
        cfg_: StackConfig, control: Control, plan: Plan, specs: dict[str, dict[str, Any]], duration_s: float
    ) -> Faults:
        f = HostFaults(cfg, cfg_, control, plan, specs, duration_s)
        f.actions = ["host-loss"]
        made.append(f)
        return f

    try:
        report = run(hosts.stack_config(cfg), PLAN, log=_log, settle_s=240, faults_factory=one_fault)
    finally:
        hosts.down(cfg)
    [fault] = report["faults"]
    if fault["error"]:
        raise RuntimeError(f"the host-loss fault failed: {fault['error']}")
    measured = fault["measured"]
    fresh = measured.get("counted_s", {})
    return {
        "host": measured.get("host"),
        "failover_s": measured.get("failover_s"),
        "fresh_again_s": fresh,
        "worst_fresh_again_s": max(fresh.values()) if fresh else None,
        "exact": all(job["ok"] for job in report["jobs"]) and not report["version_regressions"],
    }
