"""What operators load into their own monitoring: the alert and recording rules (rules/), example
Alertmanager routes, and Grafana dashboards built as code (grafana/)."""
