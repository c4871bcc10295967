"""Root of the platform's exceptions; each service derives its own from it."""


class StreamForgeError(Exception):
    """Base class of every error the platform raises on purpose."""


class SpecError(StreamForgeError):
    """A job spec or stream definition is invalid; the message says what to fix."""
