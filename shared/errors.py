"""Root of the platform's exceptions; each service derives its own from it."""


class StreamForgeError(Exception):
    """Base class of every error the platform raises on purpose."""

    # The exit status of a service this error stops (shared.service.run_service).
    exit_code: int = 1


class SpecError(StreamForgeError):
    """A job spec or stream definition is invalid; the message says what to fix."""

    exit_code = 2
