"""gRPC: JobCommands (start, stop, stop with savepoint, status, list), StreamConfig (the active jobs'
specs, for an idle processor's warm-ups: warmup/shapes.py) and grpc.health.v1.

Errors map to status codes control acts on: a bad spec is INVALID_ARGUMENT, a job already running is
ALREADY_EXISTS, an unknown job NOT_FOUND, a savepoint that cannot be read or taken FAILED_PRECONDITION
(after a failed stop-with-savepoint the job keeps running), a checkpoint another processor's query still
holds ABORTED (retry once that copy stops), anything else INTERNAL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from services.processor.errors import (
    CheckpointTakenError,
    JobNotFoundError,
    JobStateError,
    PathRefusedError,
    ProcessorError,
    SavepointError,
)
from services.processor.jobs.runner import JobRunner
from services.processor.jobs.table import JobView
from services.processor.warmup.shapes import ShapeWarmer
from shared.errors import SpecError
from shared.grpc_server import GrpcServices
from shared.jobspec import JobSpec, spec_from_json, with_id
from shared.proto import streamforge_pb2 as pb
from shared.proto import streamforge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
JOB_COMMANDS_SERVICE = "streamforge.v1.JobCommands"
STREAM_CONFIG_SERVICE = "streamforge.v1.StreamConfig"
T = TypeVar("T")


def to_proto(view: JobView) -> pb.JobStatus:
    status = pb.JobStatus(
        job_id=view.job_id,
        state=view.state.to_proto(),
        message=view.message,
        savepoint_path=view.savepoint_path,
    )
    if view.metrics is not None:
        m = view.metrics.latest
        status.metrics.CopyFrom(
            pb.JobMetrics(
                batch_id=m.batch_id,
                input_rows_per_second=m.input_rows_per_second,
                processed_rows_per_second=m.processed_rows_per_second,
                batch_duration_ms=m.batch_duration_ms,
                watermark_ms=m.watermark_ms or 0,
                state_rows=m.state_rows,
                state_memory_bytes=m.state_memory_bytes,
                rows_dropped_by_watermark=view.metrics.rows_dropped_by_watermark,
                commit_duration_ms=m.commit_duration_ms,
            )
        )
    return status


def spec_of(request: pb.StartJobRequest, savepoint_spec: Callable[[str], JobSpec]) -> JobSpec:
    """The request's spec under the request's job id (a restore may rename a job)."""
    if request.spec_json:
        spec = spec_from_json(request.spec_json)
    elif request.from_savepoint:
        spec = savepoint_spec(request.from_savepoint)  # no spec: run the savepoint's own
    else:
        raise SpecError("StartJob needs spec_json (or from_savepoint to run the savepoint's spec)")
    return with_id(spec, request.job_id) if request.job_id else spec


def _abort(context: grpc.ServicerContext, e: Exception) -> NoReturn:
    if isinstance(e, SpecError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, JobNotFoundError):
        context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    if isinstance(e, JobStateError):
        code = grpc.StatusCode.ALREADY_EXISTS if "already" in str(e) else grpc.StatusCode.FAILED_PRECONDITION
        context.abort(code, str(e))
    if isinstance(e, CheckpointTakenError):
        # Another processor's start took the job's checkpoint first: control sorts out where it runs.
        context.abort(grpc.StatusCode.ABORTED, str(e))
    if isinstance(e, SavepointError):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    if isinstance(e, PathRefusedError):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
    log.exception("command failed")
    context.abort(grpc.StatusCode.INTERNAL, str(e))
    raise AssertionError("context.abort() raises")  # for the type checker


class JobCommandsService(pb_grpc.JobCommandsServicer):
    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    def StartJob(self, request: pb.StartJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        try:
            self.runner.check_savepoint_path(request.from_savepoint, "from_savepoint")
            spec = spec_of(request, self.runner.savepoint_spec)
            view = self.runner.start(spec, request.from_savepoint)
        except (SpecError, ProcessorError) as e:
            _abort(context, e)
        origin = f" from savepoint {request.from_savepoint}" if request.from_savepoint else ""
        log.info("StartJob %s%s: %s", spec.id, origin, view.state)
        return to_proto(view)

    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        try:
            view = self.runner.stop(request.job_id, request.savepoint, request.savepoint_dir)
        except (SpecError, ProcessorError) as e:
            _abort(context, e)
        log.info("StopJob %s (savepoint: %s): %s", request.job_id, request.savepoint, view.state)
        return to_proto(view)

    def GetStatus(self, request: pb.JobRef, context: grpc.ServicerContext) -> pb.JobStatus:
        try:
            return to_proto(self.runner.get(request.job_id))
        except ProcessorError as e:
            _abort(context, e)

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[to_proto(v) for v in self.runner.list()])


class StreamConfigService(pb_grpc.StreamConfigServicer):
    """Control sends the specs of the active jobs: an idle processor warms up on their shapes."""

    def __init__(self, warmer: ShapeWarmer) -> None:
        self.warmer = warmer

    def ApplyStreams(
        self, request: pb.ApplyStreamsRequest, context: grpc.ServicerContext
    ) -> pb.ApplyStreamsResponse:
        try:
            specs = [spec_from_json(text) for text in request.job_spec_json]
        except SpecError as e:
            _abort(context, e)
        added = self.warmer.offer(specs)
        if added:
            log.info("control sent %d job specs: %d new shapes to warm up on while idle", len(specs), added)
        return pb.ApplyStreamsResponse()


def grpc_services(runner: JobRunner, warmer: ShapeWarmer) -> GrpcServices:
    def add(server: grpc.Server) -> None:
        pb_grpc.add_JobCommandsServicer_to_server(JobCommandsService(runner), server)
        pb_grpc.add_StreamConfigServicer_to_server(StreamConfigService(warmer), server)

    return GrpcServices(add, [JOB_COMMANDS_SERVICE, STREAM_CONFIG_SERVICE])
