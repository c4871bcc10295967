"""The few pieces of Grafana's dashboard JSON model the dashboards use, as plain dataclasses.

Grafana's schema (version 39) for time series, stat and bar gauge panels on a Prometheus data source
picked by the ``datasource`` variable, so a dashboard imports into any Grafana with any source name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
GRID_WIDTH = 24


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""

    def json(self, ref: str) -> dict[str, Any]:
        return {"refId": ref, "datasource": DATASOURCE, "expr": self.expr, "legendFormat": self.legend}


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    kind: Literal["timeseries", "stat", "bargauge"] = "timeseries"
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    max: float | None = None

    def json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        defaults: dict[str, Any] = {"unit": self.unit}
        if self.max is not None:
            defaults |= {"min": 0, "max": self.max}
        return {
            "id": panel_id,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": DATASOURCE,
            "gridPos": {"x": x, "y": y, "w": self.width, "h": self.height},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom"}}
            if self.kind == "timeseries"
            else {},
            "targets": [q.json(chr(ord("A") + i)) for i, q in enumerate(self.queries)],
        }


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    tags: tuple[str, ...] = ("streamforge",)
    refresh: str = "10s"
    variables: tuple[str, ...] = field(default=("job",))

    def json(self) -> dict[str, Any]:
        """The dashboard's JSON, panels laid out left to right, top to bottom."""
        panels, x, y, row_height = [], 0, 0, 0
        for i, panel in enumerate(self.panels, start=1):
            if x + panel.width > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            panels.append(panel.json(i, x, y))
            x, row_height = x + panel.width, max(row_height, panel.height)
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "schemaVersion": SCHEMA_VERSION,
            "refresh": self.refresh,
            "time": {"from": "now-1h", "to": "now"},
            "timezone": "utc",
            "templating": {"list": [_datasource_variable(), *(_label_variable(v) for v in self.variables)]},
            "panels": panels,
        }


def _datasource_variable() -> dict[str, Any]:
    return {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}


def _label_variable(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": f"label_values(records_processed_total, {name})", "refId": "A"},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
    }
