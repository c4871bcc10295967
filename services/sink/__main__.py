"""`python -m services.sink`: write window results to Redis until SIGTERM."""

from __future__ import annotations

import signal
import sys

from services.sink.app import Sink
from services.sink.settings import SinkSettings
from shared.errors import StreamForgeError
from shared.logs import configure_logging
from shared.metrics import serve_metrics


def main() -> int:
    settings = SinkSettings()
    log = configure_logging("sink", settings.log_level)
    sink = Sink(settings)
    signal.signal(signal.SIGTERM, lambda *_: sink.stop())
    signal.signal(signal.SIGINT, lambda *_: sink.stop())
    try:
        sink.start()
        # The metrics port opens once the service is really running: stack readiness relies on it.
        serve_metrics(settings.metrics_port)
        sink.run()
    except StreamForgeError as e:
        log.error("%s", e)
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
