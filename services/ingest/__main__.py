"""`python -m services.ingest`: validate and forward raw events until SIGTERM."""

from __future__ import annotations

import signal
import sys

from services.ingest.app import Ingest
from services.ingest.settings import IngestSettings
from shared.errors import StreamForgeError
from shared.jobspec import load_job_spec
from shared.logs import configure_logging
from shared.metrics import serve_metrics


def main() -> int:
    settings = IngestSettings()
    log = configure_logging("ingest", settings.log_level)
    try:
        streams = [load_job_spec(p).source for p in settings.job_specs]
        ingest = Ingest(settings, streams)
    except StreamForgeError as e:  # a bad spec or setting: say what to fix, do not start
        log.error("%s", e)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: ingest.stop())
    signal.signal(signal.SIGINT, lambda *_: ingest.stop())
    try:
        ingest.start()
    except StreamForgeError as e:
        log.error("%s", e)
        return 2
    # The metrics port opens once the service is really running: stack readiness relies on it.
    serve_metrics(settings.metrics_port)
    ingest.run()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
