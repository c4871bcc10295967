"""What the processor remembers about its jobs across restarts: one JSON file per job.

``<data_dir>/jobs/<job_id>.json`` holds the spec, whether the job should run, the highest epoch the
job id has used (versions must keep growing across restores: see ``versions``) and its last
savepoint, and how often Spark's JVM died while it ran. A processor that restarts (after SIGKILL too)
starts again every job that should run, from its checkpoint, in the same epoch, unless the job was
running each time the JVM died lately (JobRunner.record_crash).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import orjson

from shared.errors import SpecError
from shared.jobspec import JobSpec, parse_job_spec, spec_to_json


@dataclass(frozen=True)
class LedgerEntry:
    spec: JobSpec
    should_run: bool
    epoch: int
    savepoint_path: str = ""
    # Times Spark's JVM died while the job ran, since its last completed micro-batch.
    crashes: int = 0

    def with_(self, **changes: object) -> LedgerEntry:
        return replace(self, **changes)  # type: ignore[arg-type]


class JobLedger:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.json"

    def get(self, job_id: str) -> LedgerEntry | None:
        try:
            raw = orjson.loads(self._path(job_id).read_bytes())
            return LedgerEntry(
                spec=parse_job_spec(orjson.dumps(raw["spec"])),
                should_run=bool(raw["should_run"]),
                epoch=int(raw["epoch"]),
                savepoint_path=str(raw.get("savepoint_path", "")),
                crashes=int(raw.get("crashes", 0)),
            )
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, SpecError):
            # A damaged record must not keep the processor from starting; the job is just not resumed.
            return None

    def put(self, job: LedgerEntry) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        body = {
            "spec": orjson.loads(spec_to_json(job.spec)),
            "should_run": job.should_run,
            "epoch": job.epoch,
            "savepoint_path": job.savepoint_path,
            "crashes": job.crashes,
        }
        path = self._path(job.spec.id)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
        tmp.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
        os.replace(tmp, path)

    def all(self) -> list[LedgerEntry]:
        if not self.directory.is_dir():
            return []
        jobs = [self.get(p.stem) for p in sorted(self.directory.glob("*.json"))]
        return [j for j in jobs if j is not None]
