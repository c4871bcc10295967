"""`python -m services.processor`: run the jobs of the given specs until SIGTERM."""

from __future__ import annotations

import signal
import sys

from services.processor.app import Processor
from services.processor.settings import ProcessorSettings
from shared.errors import StreamForgeError
from shared.jobspec import load_job_spec
from shared.logs import configure_logging
from shared.metrics import serve_metrics


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
    except StreamForgeError as e:
        log.error("%s", e)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: processor.stop())
    signal.signal(signal.SIGINT, lambda *_: processor.stop())
    try:
        processor.start()
        # The metrics port opens once every query runs: stack readiness relies on it.
        serve_metrics(settings.metrics_port)
        processor.run()
    except StreamForgeError as e:
        log.error("%s", e)
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
