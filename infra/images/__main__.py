"""`python -m infra.images [IMAGE...] [--prune]`: build the service and HDFS images (`make images`)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from infra.errors import InfraError
from infra.images.build import IMAGES, build_all, prune


def _print(msg: str) -> None:
    print(f"• {msg}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.images",
        description="Container images of the services and HDFS, built with podman from this project's files.",
    )
    parser.add_argument("services", nargs="*", default=list(IMAGES), metavar="IMAGE")
    parser.add_argument(
        "--prune", action="store_true", help="then remove this project's images older than the ones built"
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        built = build_all(args.services, log=_print)
        if args.prune:
            prune([b.pinned for b in built], log=_print)
    except InfraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for b in built:
        print(f"{b.ref:48} {'built' if b.built else 'cached':6} {b.seconds:7.1f} s {b.size_mb:8.0f} MB")
    print(f"images ready in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
