"""What the processor remembers about its jobs across restarts: one JSON file per job.

``<state_root>/processors/<name>/jobs/<job_id>.json`` holds the spec, whether the job should run, the
epoch it ran in here (its checkpoint's directory: state/checkpoints.py) and its last savepoint, and
how often Spark's JVM died while it ran. A processor that restarts (after SIGKILL too, on another
machine too) starts again every job that should run, from its checkpoint, in the same epoch, unless
another processor took the job over since or the job was running each time the JVM died lately
(JobRunner.record_crash).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import orjson

from services.processor.state.storage import StateStorage, join
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
    def __init__(self, storage: StateStorage, directory: str) -> None:
        self.storage = storage
        self.directory = directory

    def _path(self, job_id: str) -> str:
        return join(self.directory, f"{job_id}.json")

    def get(self, job_id: str) -> LedgerEntry | None:
        try:
            data = self.storage.read_bytes(self._path(job_id))
            if data is None:
                return None
            raw = orjson.loads(data)
            return LedgerEntry(
                spec=parse_job_spec(orjson.dumps(raw["spec"])),
                should_run=bool(raw["should_run"]),
                epoch=int(raw["epoch"]),
                savepoint_path=str(raw.get("savepoint_path", "")),
                crashes=int(raw.get("crashes", 0)),
            )
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, SpecError):
            # A damaged record must not keep the processor from starting; the job is just not resumed.
            return None

    def put(self, job: LedgerEntry) -> None:
        body = {
            "spec": orjson.loads(spec_to_json(job.spec)),
            "should_run": job.should_run,
            "epoch": job.epoch,
            "savepoint_path": job.savepoint_path,
            "crashes": job.crashes,
        }
        self.storage.write_atomic(self._path(job.spec.id), orjson.dumps(body, option=orjson.OPT_INDENT_2))

    def all(self) -> list[LedgerEntry]:
        names = self.storage.list_names(self.directory)
        jobs = [
            self.get(n.removesuffix(".json")) for n in names if n.endswith(".json") and not n.startswith(".")
        ]
        return [j for j in jobs if j is not None]
