"""`python -m services.processor`: run jobs (from spec files and over gRPC) until SIGTERM.

One process: the SparkSession (its JVM is a child process), the job supervisor (main thread), the
gRPC JobCommands + health server, Prometheus /metrics, and the registration with control. Start-up
and shutdown: shared/service.py.
"""

from __future__ import annotations

import sys
import time

from opentelemetry.trace import Tracer

from services.processor.errors import ProcessorError
from services.processor.service import Processor
from services.processor.settings import ProcessorSettings
from services.processor.start_clock import CLOCK
from shared.jobspec import load_job_spec
from shared.service import GrpcEndpoint, Wiring, run_service
from shared.tls import TlsIdentity

IMPORTED = time.monotonic()


def build(settings: ProcessorSettings, tracer: Tracer, _tls: TlsIdentity | None) -> Wiring:
    CLOCK.mark("imports", at=IMPORTED)
    if not settings.spark_jars:
        raise ProcessorError(
            "SF_PROCESSOR_SPARK_JARS names no jar: give the Spark-Kafka connector's jars "
            "(`python -m infra fetch` resolves them; `make demo` and the tests set this)"
        )
    specs = [load_job_spec(p) for p in settings.job_specs]
    processor = Processor(settings, specs, settings.spark_jars, tracer=tracer)
    # JobCommands over the job runner that start() builds; served once every job resumed.
    grpc = GrpcEndpoint(settings.bind_host, settings.grpc_port, processor.grpc_services)
    return Wiring(
        processor,
        grpc=grpc,
        metrics_port=settings.metrics_port,
        jobs=processor.job_statuses,
        slots=processor.task_slots,
    )


def main() -> int:
    return run_service("processor", ProcessorSettings, build)


if __name__ == "__main__":
    sys.exit(main())
