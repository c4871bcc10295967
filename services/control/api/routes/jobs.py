"""Jobs: submit (JSON or YAML), list, status, cancel, savepoint, resume, metrics and window results."""

from __future__ import annotations

from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from services.control.api.auth import AUTH_RESPONSES, require_read, require_write, token_owner
from services.control.api.deps import ManagerDep, RedisDep, SettingsDep
from services.control.api.schemas import (
    ErrorOut,
    JobListOut,
    JobMetricsOut,
    JobOut,
    JobStatusOut,
    ResultsOut,
    WindowOut,
)
from services.control.errors import JobConflict, SpecRejected, StoreUnavailable
from services.control.results import read_results
from shared.errors import SpecError
from shared.jobspec import JobSpec, parse_job_spec, with_id
from shared.jobstate import JobState
from shared.operators import check_process

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=AUTH_RESPONSES)
Read = [Depends(require_read)]
Write = [Depends(require_write)]

JSON_TYPES = frozenset({"application/json"})
YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})
JOB_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
PATH_PATTERN = r"^[^\x00\r\n]*$"

# The body is read by hand (JSON or YAML); this tells OpenAPI what it is. The JobSpec schema itself is
# merged into components by the app (see api/__init__.py).
SPEC_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "A job spec as JSON (application/json) or YAML (application/yaml, text/yaml).",
        "content": {
            media: {"schema": {"$ref": "#/components/schemas/JobSpec"}}
            for media in ("application/json", "application/yaml")
        },
    }
}
WaitQuery = Annotated[
    bool, Query(description="wait a bounded time for the processor's answer (202 if it has not come)")
]
ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorOut, "description": "no such job"},
    409: {"model": ErrorOut, "description": "the job's state does not allow this"},
}


def _wait_s(settings: SettingsDep, wait: bool) -> float:
    return settings.tuning.request_wait_ms / 1000 if wait else 0.0


async def _read_spec(request: Request, max_bytes: int) -> JobSpec:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in JSON_TYPES | YAML_TYPES:
        raise HTTPException(
            415,
            f"Content-Type {media or '(none)'!r} is not a job spec: "
            "send application/json or application/yaml",
        )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HTTPException(413, f"the job spec is larger than {max_bytes} bytes")
    if not body.strip():
        raise HTTPException(422, "the request body is empty: send a job spec as JSON or YAML")
    try:
        # Off the event loop: parsing a large spec must not hold every other request (/healthz too).
        return await run_in_threadpool(_parse_and_check, bytes(body), media in YAML_TYPES)
    except SpecError as e:
        raise HTTPException(422, str(e)) from e


def _parse_and_check(body: bytes, yaml_format: bool) -> JobSpec:
    """The spec, with its operator's parameters validated by the operator installed here."""
    spec = parse_job_spec(body, yaml_format=yaml_format)
    check_process(spec)
    return spec


SUBMIT = {
    "status_code": 201,
    "response_model": JobOut,
    "dependencies": Write,
    "openapi_extra": SPEC_BODY,
    "responses": {
        409: {"model": ErrorOut, "description": "a job with this id is still active"},
        413: {"model": ErrorOut, "description": "the spec is too large"},
        415: {"model": ErrorOut, "description": "the body is neither JSON nor YAML"},
        422: {"model": ErrorOut, "description": "the spec is invalid, or the processor rejected it"},
        429: {
            "model": ErrorOut,
            "description": "no processor has the job's task slots free (the reason names them), or the "
            "token is over its jobs or submissions per minute (with Retry-After)",
        },
    },
}


@router.post("", summary="Submit a job", **SUBMIT)  # type: ignore[arg-type]
@router.post("/submit", summary="Submit a job (alias of POST /jobs)", **SUBMIT)  # type: ignore[arg-type]
async def submit_job(
    request: Request,
    manager: ManagerDep,
    settings: SettingsDep,
    from_savepoint: Annotated[
        str,
        Query(max_length=4096, pattern=PATH_PATTERN, description="start from this savepoint path"),
    ] = "",
    wait: WaitQuery = True,
) -> JobOut:
    """Validate the spec, store the job (CREATED) and start it on a live processor (RUNNING).

    The job goes to the processor with the most task slots free for it; when none has enough it is
    refused (429) and the running jobs keep theirs. With no processor registered the job stays
    CREATED and starts when one registers. A job id that is still active is refused (409); a final
    one (FAILED, CANCELED, FINISHED) is replaced.
    """
    spec = await _read_spec(request, settings.max_spec_bytes)
    job = await run_in_threadpool(
        lambda: manager.submit(spec, from_savepoint, _wait_s(settings, wait), owner=token_owner(request))
    )
    if job.state == JobState.FAILED:
        raise SpecRejected(job.message)
    return JobOut.of(job)


@router.get("", response_model=JobListOut, dependencies=Read)
def list_jobs(
    manager: ManagerDep,
    state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
) -> JobListOut:
    jobs = [JobStatusOut.of(j) for j in manager.jobs.list() if state is None or j.state == state]
    return JobListOut(count=len(jobs), jobs=jobs)


@router.get("/{job_id}", response_model=JobOut, dependencies=Read, responses=ERRORS)
def get_job(job_id: str, manager: ManagerDep) -> JobOut:
    """The job with its spec and its last state changes."""
    return JobOut.of(manager.get(job_id))


@router.get("/{job_id}/status", response_model=JobStatusOut, dependencies=Read, responses=ERRORS)
def job_status(job_id: str, manager: ManagerDep) -> JobStatusOut:
    return JobStatusOut.of(manager.get(job_id))


@router.post(
    "/{job_id}/cancel",
    response_model=JobStatusOut,
    dependencies=Write,
    responses={**ERRORS, 202: {"model": JobStatusOut, "description": "CANCELLING: the processor stops it"}},
)
def cancel_job(
    job_id: str, manager: ManagerDep, settings: SettingsDep, response: Response, wait: WaitQuery = True
) -> JobStatusOut:
    """Stop the job without a savepoint: CANCELLING, then CANCELED (200 once CANCELED, else 202)."""
    job = manager.cancel(job_id, _wait_s(settings, wait))
    response.status_code = 200 if job.state.is_final else 202
    return JobStatusOut.of(job)


@router.post(
    "/{job_id}/savepoint",
    response_model=JobStatusOut,
    dependencies=Write,
    responses={
        **ERRORS,
        202: {"model": JobStatusOut, "description": "CANCELLING: the savepoint is on its way"},
    },
)
def savepoint_job(
    job_id: str,
    manager: ManagerDep,
    settings: SettingsDep,
    response: Response,
    directory: Annotated[
        str,
        Query(
            max_length=4096, pattern=PATH_PATTERN, description="where to put it (default: the processor's)"
        ),
    ] = "",
    wait: WaitQuery = True,
) -> JobStatusOut:
    """Stop the job at a batch boundary with a savepoint: FINISHED with ``savepoint_path`` (200), or
    still CANCELLING (202). Resume it with POST /jobs/{id}/resume or POST /jobs?from_savepoint=."""
    job = manager.savepoint(job_id, directory, _wait_s(settings, wait))
    response.status_code = 200 if job.state.is_final else 202
    return JobStatusOut.of(job)


@router.post(
    "/{job_id}/resume",
    status_code=201,
    response_model=JobOut,
    dependencies=Write,
    responses={
        **ERRORS,
        422: {"model": ErrorOut, "description": "the processor rejected the job"},
        429: {"model": ErrorOut, "description": "no processor has its task slots free, or the token's share"},
    },
)
def resume_job(
    request: Request,
    job_id: str,
    manager: ManagerDep,
    settings: SettingsDep,
    savepoint: Annotated[
        str,
        Query(max_length=4096, pattern=PATH_PATTERN, description="default: the job's last savepoint"),
    ] = "",
    new_id: Annotated[
        str | None, Query(pattern=JOB_ID_PATTERN, description="run the same spec under another id")
    ] = None,
    wait: WaitQuery = True,
) -> JobOut:
    """Start a final job's spec again from a savepoint, under its own id or ``new_id``."""
    old = manager.get(job_id)
    path = savepoint or old.savepoint_path
    if not path:
        raise JobConflict(
            f"job {job_id!r} has no savepoint: take one with POST /jobs/{job_id}/savepoint, "
            "or pass ?savepoint="
        )
    try:
        spec = with_id(old.spec, new_id or job_id)
    except SpecError as e:  # the stored spec no longer validates (the spec format moved on)
        raise HTTPException(422, f"the stored spec of {job_id!r} is no longer valid: {e}") from e
    # The job's own savepoint path came from its processor; a path the caller names is checked.
    job = manager.submit(
        spec, path, _wait_s(settings, wait), trusted_savepoint=not savepoint, owner=token_owner(request)
    )
    if job.state == JobState.FAILED:
        raise SpecRejected(job.message)
    return JobOut.of(job)


@router.get("/{job_id}/metrics", response_model=JobMetricsOut, dependencies=Read, responses=ERRORS)
def job_metrics(job_id: str, manager: ManagerDep) -> JobMetricsOut:
    """The processor's last report for the job: rows/s, batch duration, watermark, state size..."""
    job = manager.get(job_id)
    return JobMetricsOut(
        id=job.id,
        state=job.state,
        processor=job.processor,
        metrics=job.metrics,
        metrics_at_ms=job.metrics_at_ms,
    )


@router.get("/{job_id}/results", response_model=ResultsOut, dependencies=Read)
def job_results(
    job_id: str,
    client: RedisDep,
    key: Annotated[str | None, Query(description="only this key")] = None,
    start: Annotated[int | None, Query(description="windows starting at or after (epoch ms)")] = None,
    end: Annotated[int | None, Query(description="windows starting before (epoch ms)")] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> ResultsOut:
    """Window results from Redis, by key and window-start range (also for jobs started outside control)."""
    if start is not None and end is not None and end <= start:
        raise HTTPException(422, f"end ({end}) must be greater than start ({start})")
    try:
        windows = read_results(client, job_id, key, start, end, limit)
    except redis.RedisError as e:
        raise StoreUnavailable(f"Redis, which holds the results, is unavailable: {e}") from e
    return ResultsOut(job_id=job_id, count=len(windows), results=[WindowOut(**w) for w in windows])
