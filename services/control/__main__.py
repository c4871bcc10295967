"""`python -m services.control`: serve the control API until SIGTERM."""

from __future__ import annotations

import sys

import uvicorn

from services.control.api import create_app
from services.control.settings import ControlSettings
from shared.logs import configure_logging


def main() -> int:
    settings = ControlSettings()
    configure_logging("control", settings.log_level)
    # uvicorn drains in-flight requests on SIGTERM by itself.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
