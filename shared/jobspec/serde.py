"""A spec in and out of text: JSON or YAML files and texts in, the canonical JSON text out.

Every problem becomes a SpecError that says what to fix.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
import yaml
from pydantic import ValidationError

from shared.errors import SpecError
from shared.jobspec.spec import JobSpec

# A job spec nests a few levels; deeper YAML is refused before it is built: PyYAML's constructor
# recurses, so deep input raises RecursionError, and libyaml's can crash the whole process.
MAX_SPEC_DEPTH = 32
# libyaml's safe loader where PyYAML has it: the pure-Python one is much slower.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_YAML_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def load_job_spec(path: str | Path) -> JobSpec:
    """Read a spec from a .json/.yaml/.yml file; a bad spec raises SpecError saying what to fix."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read job spec {p}: {e.strerror}") from e
    return parse_job_spec(text, yaml_format=p.suffix in (".yaml", ".yml"))


def _yaml_depth_problem(text: str | bytes) -> str | None:
    """Scans the YAML's events (flat, no recursion): why it is refused, or None."""
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, _YAML_OPEN):
            depth += 1
            if depth > MAX_SPEC_DEPTH:
                return f"job spec nests deeper than {MAX_SPEC_DEPTH} levels"
        elif isinstance(event, _YAML_CLOSE):
            depth -= 1
    return None


def parse_job_spec(text: str | bytes, *, yaml_format: bool = False) -> JobSpec:
    """A spec from JSON or YAML text; SpecError (with what to fix) for anything else."""
    try:
        if yaml_format:
            problem = _yaml_depth_problem(text)
            if problem is not None:
                raise SpecError(problem)
            raw = yaml.load(text, Loader=_YAML_LOADER)
        else:
            raw = orjson.loads(text)  # refuses more than 1024 levels itself
    except (yaml.YAMLError, orjson.JSONDecodeError) as e:
        raise SpecError(f"job spec is not valid {'YAML' if yaml_format else 'JSON'}: {e}") from e
    except RecursionError:
        raise SpecError(f"job spec nests deeper than {MAX_SPEC_DEPTH} levels") from None
    if not isinstance(raw, dict):
        raise SpecError("job spec must be a mapping at the top level")
    return _validate(raw)


def _validate(raw: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<spec>'}: {err['msg']}" for err in e.errors()
        )
        raise SpecError(f"invalid job spec: {problems}") from e


def spec_to_json(spec: JobSpec) -> str:
    """The spec's canonical JSON text: the one form a spec is stored and sent in between services."""
    return spec.model_dump_json(by_alias=True, exclude_none=True)


@lru_cache(maxsize=256)
def spec_from_json(text: str) -> JobSpec:
    """The spec of a canonical JSON text (``spec_to_json``), parsed once per process and text.

    Control's job store and the StartJob and ApplyStreams requests carry specs as that text; the same
    few texts come again and again (every ApplyStreams repeats every active job's), so each is parsed
    and validated once. JobSpec is frozen: the cached object is safe to share.
    """
    return parse_job_spec(text)


def with_id(spec: JobSpec, job_id: str) -> JobSpec:
    """The same spec under another job id (validated like any spec)."""
    if job_id == spec.id:
        return spec
    return _validate({**spec.model_dump(mode="json", by_alias=True, exclude_none=True), "id": job_id})
