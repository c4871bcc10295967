"""The Grafana dashboards built as code: the JSON in the repository is what the code builds, each has
the design's panels, every query parses (promtool) and names only metrics StreamForge exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from infra.artifacts.apt import PROMTOOL
from infra.local.prometheus import RULES_DIR
from infra.monitoring.grafana.__main__ import rendered
from infra.monitoring.grafana.dashboards import DASHBOARDS
from tests.metrics_util import SERVICE_METRICS

# Families a query may name besides the services' shared ones: their own metrics, Prometheus's.
KNOWN = {
    "up",
    "ALERTS",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "sink_write_reduction_ratio",
    "job_freshness_target_seconds",
    "control_jobs",
    "control_live_instances",
    "processor_task_slots",
    "processor_task_slots_held",
    "processor_job_restarts_total",
}
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "max", "or", "on", "clamp_min"}


def _queries() -> list[str]:
    return [t["expr"] for d in DASHBOARDS for p in d.json()["panels"] for t in p["targets"]]


def test_the_json_in_the_repository_is_what_the_code_builds() -> None:
    for path, text in rendered().items():
        assert path.read_text() == text, f"{path.name} is stale: run python -m infra.monitoring.grafana"


def test_the_four_dashboards_of_the_design() -> None:
    titles = {d.title.split("· ")[1] for d in DASHBOARDS}
    assert titles == {"Job Overview", "Service health", "Checkpoints", "Backpressure"}
    for d in DASHBOARDS:
        doc = json.loads(rendered()[Path(__file__).parents[2] / "infra/monitoring/grafana" / f"{d.uid}.json"])
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids)) and doc["panels"]
        for p in doc["panels"]:
            grid = p["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and p["targets"] and p["datasource"]["uid"] == "${datasource}"


def test_every_query_parses(tmp_path: Path) -> None:
    """promtool checks each query as a recording rule's expression (the variable as a regex)."""
    rules = [
        {"record": f"grafana:query_{i}", "expr": q.replace("$job", ".*")} for i, q in enumerate(_queries())
    ]
    path = tmp_path / "grafana.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    proc = subprocess.run(
        [PROMTOOL.ensure_installed(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_query_names_a_metric_streamforge_exports() -> None:
    recorded = {
        r["record"]
        for g in yaml.safe_load((RULES_DIR / "streamforge.rules.yml").read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    }
    exported = {name for names in SERVICE_METRICS.values() for name in names} | KNOWN | recorded
    exported |= {f"{n}_{s}" for n in exported for s in ("bucket", "count", "sum")}
    for q in _queries():
        names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{|\[|\)|\s|$)", re.sub(r'"[^"]*"', "", q)))
        names -= PROMQL_WORDS | {"job", "service", "le", "stage", "reason", "instance", "alertname", "state"}
        unknown = {n for n in names if not n.replace(".", "").isdigit()} - exported
        assert not unknown, f"{q!r} names {unknown}"
