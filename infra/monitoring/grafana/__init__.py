"""The design's four Grafana dashboards, built as code: ``python -m infra.monitoring.grafana`` writes
their JSON beside this file (tests/unit/test_grafana_dashboards.py fails when it is stale)."""
