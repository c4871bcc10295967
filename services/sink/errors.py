"""The sink's exceptions: one root for everything the sink raises on purpose."""

from __future__ import annotations

from shared.errors import StreamForgeError


class SinkError(StreamForgeError):
    """Root of the sink's own errors."""


class DeadLetterError(SinkError):
    """A record could not be parked in the dead-letter topic: its offset must not be committed."""
