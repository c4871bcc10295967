"""The one exception type infra raises for problems a person has to fix (missing tool, port taken...)."""


class InfraError(Exception):
    """A local-infrastructure problem; the message says what went wrong and what to do about it."""
