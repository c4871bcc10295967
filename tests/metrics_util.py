"""Checks of Prometheus exposition text: it parses, and carries the metric names the design asks for.

Parsing is prometheus_client's own (text_string_to_metric_families), so "parses" means what a Prometheus
server would accept from a text scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Expected:
    """A metric as the design names it: its type and the labels its samples must carry."""

    type: str
    labels: frozenset[str] = field(default_factory=frozenset)


def _e(type_: str, *labels: str) -> Expected:
    return Expected(type_, frozenset(labels))


# Every service imports shared.metrics, so each /metrics carries these families (a family whose
# metric has no children yet shows as HELP/TYPE lines only, without samples).
SHARED_METRICS: dict[str, Expected] = {
    "records_processed_total": _e("counter", "service", "job"),
    "processing_latency_seconds": _e("histogram", "service", "job", "stage"),
    "checkpoint_duration_seconds": _e("histogram", "service", "job"),
    "consumer_lag_records": _e("gauge", "service", "job"),
    "watermark_lag_ms": _e("gauge", "service", "job"),
    "state_size_bytes": _e("gauge", "service", "job"),
    "late_events_total": _e("counter", "service", "job"),
    "dlq_events_total": _e("counter", "service", "job", "reason"),
    "backpressure_blocked_seconds_total": _e("counter", "service"),
    "backpressure_ratio": _e("gauge", "service"),
}
# The sink cache's write reduction: updates received per Redis write (services/sink/metrics.py).
SINK_METRICS: dict[str, Expected] = {"sink_write_reduction_ratio": _e("gauge", "job")}
SERVICE_METRICS: dict[str, dict[str, Expected]] = {
    "ingest": SHARED_METRICS,
    "processor": SHARED_METRICS,
    "sink": {**SHARED_METRICS, **SINK_METRICS},
    "control": SHARED_METRICS,
}


def parse_exposition(text: str) -> dict[str, Metric]:
    """Families by the name they are exposed under (a counter by its `_total` sample name).

    Raises ValueError (from the parser) when the text is not valid exposition format.
    """
    families: dict[str, Metric] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family
        if family.type == "counter":
            families[family.name + "_total"] = family
    return families


def assert_exposition_has(text: str, names: Iterable[str] | Mapping[str, Expected]) -> dict[str, Metric]:
    """Assert `text` parses and has every metric in `names` (with its type and labels, when given).

    Labels are checked on every sample of the family; a family without samples passes on name and type.
    Returns the parsed families.
    """
    families = parse_exposition(text)
    expected = names if isinstance(names, Mapping) else {n: None for n in names}
    missing = sorted(n for n in expected if n not in families)
    assert not missing, f"metrics missing from the exposition: {missing}; present: {sorted(families)}"
    problems = []
    for name, want in expected.items():
        if want is None:
            continue
        family = families[name]
        if family.type != want.type:
            problems.append(f"{name} is a {family.type}, expected a {want.type}")
        for sample in family.samples:
            absent = want.labels - set(sample.labels)
            if absent:
                problems.append(f"{sample.name}{sample.labels} lacks label(s) {sorted(absent)}")
                break
    assert not problems, "; ".join(problems)
    return families


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """GET a /metrics endpoint; its text."""
    resp = httpx.get(url, timeout=timeout_s)
    resp.raise_for_status()
    return resp.text


def sample_value(families: Mapping[str, Metric], sample_name: str, **labels: str) -> float | None:
    """Value of the sample `sample_name` whose labels include `labels`, or None."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
