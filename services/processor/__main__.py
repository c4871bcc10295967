"""`python -m services.processor`: run jobs (from spec files and over gRPC) until SIGTERM.

One process: the SparkSession (its JVM is a child process), the job supervisor (main thread), the
gRPC JobCommands + health server, Prometheus /metrics, and the registration with control.
"""

from __future__ import annotations

import signal
import sys

from services.processor.app import Processor
from services.processor.settings import ProcessorSettings
from shared.errors import StreamForgeError
from shared.jobspec import load_job_spec
from shared.logs import configure_logging
from shared.metrics import serve_metrics
from shared.registry import start_registration
from shared.tracing import grpc_server_interceptor, setup_tracing, shutdown_tracing


def _connector_jars(settings: ProcessorSettings) -> list[str]:
    if settings.spark_jars:
        return settings.spark_jars
    from infra.fetch import spark_kafka_jars  # the local cache that `python -m infra fetch` fills

    return [str(p) for p in spark_kafka_jars()]


def main() -> int:
    settings = ProcessorSettings()
    log = configure_logging("processor", settings.log_level)
    try:
        specs = [load_job_spec(p) for p in settings.job_specs]
        processor = Processor(settings, specs, _connector_jars(settings))
    except StreamForgeError as e:  # a bad spec or setting: say what to fix, do not start
        log.error("%s", e)
        return 2
    tracer = setup_tracing("processor", settings)
    signal.signal(signal.SIGTERM, lambda *_: processor.stop())
    signal.signal(signal.SIGINT, lambda *_: processor.stop())
    registration = None
    try:
        processor.start(interceptors=[grpc_server_interceptor(tracer)], tracer=tracer)
        # The metrics port opens once every job runs: stack readiness relies on it.
        serve_metrics(settings.metrics_port)
        registration = start_registration(
            settings,
            "processor",
            grpc_port=settings.grpc_port,
            metrics_port=settings.metrics_port,
            jobs=processor.job_statuses,
        )
        processor.run()
    except StreamForgeError as e:
        log.error("%s", e)
        processor.close()
        return 1
    finally:
        if registration is not None:
            registration.stop()
        shutdown_tracing()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
