"""Generate the Python code of every .proto in this folder (idempotent; skips when up to date)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def outputs(proto: Path) -> list[Path]:
    stem = proto.with_suffix("")
    return [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]


def build(force: bool = False) -> list[Path]:
    built = []
    for proto in sorted(HERE.glob("*.proto")):
        outs = outputs(proto)
        if not force and all(o.exists() and o.stat().st_mtime >= proto.stat().st_mtime for o in outs):
            continue
        # Run from the project root so generated imports read `from shared.proto import x_pb2`.
        rel = proto.relative_to(ROOT)
        args = [
            "protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
        ]
        if protoc.main([*args, str(rel)]) != 0:
            raise SystemExit(f"protoc failed on {rel}")
        built.append(proto)
    return built


if __name__ == "__main__":
    done = build(force="--force" in sys.argv)
    print(f"protobuf: generated {', '.join(p.name for p in done)}" if done else "protobuf: up to date")
