"""Run every tests/bench/bench_*.py (or those named on the command line) and print their numbers.

Each module has `main() -> dict[str, float | str]`; its result is printed and written to
.run/bench/<name>.json so a closing note can quote the numbers and the command that produced them.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / ".run" / "bench"


def main(argv: list[str]) -> int:
    names = argv or sorted(p.stem.removeprefix("bench_") for p in HERE.glob("bench_*.py"))
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        module = importlib.import_module(f"tests.bench.bench_{name}")
        started = time.monotonic()
        result = module.main()
        result["wall_s"] = round(time.monotonic() - started, 1)
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=2))
        print(f"== bench {name}")
        for k, v in result.items():
            print(f"   {k}: {v}")
    if not names:
        print("no benchmarks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
