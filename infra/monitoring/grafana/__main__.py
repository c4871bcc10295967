"""``python -m infra.monitoring.grafana``: write each dashboard's JSON beside this file."""

from __future__ import annotations

import json
from pathlib import Path

from infra.monitoring.grafana.dashboards import DASHBOARDS

HERE = Path(__file__).parent


def rendered() -> dict[Path, str]:
    return {HERE / f"{d.uid}.json": json.dumps(d.json(), indent=2) + "\n" for d in DASHBOARDS}


def main() -> None:
    for path, text in rendered().items():
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
