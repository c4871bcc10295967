"""The processor's exceptions, under the platform's root (shared.errors.StreamForgeError)."""

from __future__ import annotations

from shared.errors import StreamForgeError


class ProcessorError(StreamForgeError):
    """Root of the processor's own errors."""


class JobNotFoundError(ProcessorError):
    """No job with that id is known to this processor."""


class JobStateError(ProcessorError):
    """The command does not fit the job's state (e.g. starting a job that is running)."""


class SavepointError(ProcessorError):
    """A savepoint cannot be taken or read (missing, incomplete, or for another source)."""


class PathRefusedError(ProcessorError):
    """A command named a savepoint path outside the allowed roots (SF_PROCESSOR_SAVEPOINT_ROOTS)."""


class CheckpointTakenError(ProcessorError):
    """Another processor took the job's checkpoint first (its takeover rename won): not started here."""
