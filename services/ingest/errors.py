"""Ingest's exceptions, under one root."""

from __future__ import annotations

from confluent_kafka import KafkaError

from shared.errors import StreamForgeError

# Another incarnation of this replica (same transactional id or group instance id) took over.
FENCED_CODES = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.FENCED_INSTANCE_ID,
    }
)


class IngestError(StreamForgeError):
    """Root of ingest's own errors."""


class StreamConfigError(IngestError):
    """Stream definitions that cannot be applied (conflicting, unreadable); the message says why."""

    exit_code = 2


class FatalKafkaError(IngestError):
    """The producer was fenced or hit a fatal error: only a restart of this replica is safe."""

    exit_code = 3

    def __init__(self, message: str, error: KafkaError | None = None) -> None:
        super().__init__(message)
        # Fenced: a newer incarnation runs; restarting would fence it in turn. Else the client is broken.
        self.fenced = error is not None and error.code() in FENCED_CODES
