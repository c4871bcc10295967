"""Ingest's exceptions, under one root."""

from __future__ import annotations

from shared.errors import StreamForgeError


class IngestError(StreamForgeError):
    """Root of ingest's own errors."""


class StreamConfigError(IngestError):
    """Stream definitions that cannot be applied (conflicting, unreadable); the message says why."""

    exit_code = 2


class FatalKafkaError(IngestError):
    """The producer was fenced or hit a fatal error: only a restart of this replica is safe."""

    exit_code = 3
