"""`python -m services.control`: serve the control API and the gRPC Registry until SIGTERM."""

from __future__ import annotations

import sys
from typing import cast

import uvicorn
from pydantic import ValidationError

from services.control.api import create_app
from services.control.settings import ControlSettings
from shared.logs import configure_logging
from shared.tracing import TracingSettings, setup_tracing, shutdown_tracing


def main() -> int:
    try:
        settings = ControlSettings()
    except ValidationError as e:  # fail fast, saying which setting to fix
        print(f"control: invalid settings:\n{e}", file=sys.stderr)
        return 2
    log = configure_logging("control", settings.log_level)
    if settings.auth_disabled:
        log.warning(
            "SF_CONTROL_AUTH_DISABLED=true: anyone who reaches port %d can change jobs", settings.port
        )
    elif not settings.tokens:
        log.warning("no SF_CONTROL_TOKENS: reads are open and every change is refused (401)")
    tracer = setup_tracing("control", cast(TracingSettings, settings))
    try:
        # uvicorn drains in-flight requests on SIGTERM; the app's lifespan then stops gRPC and the
        # supervisor.
        app = create_app(settings, tracer=tracer)
        uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
    finally:
        shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
