"""Local infrastructure for the platform: fetches jars, runs Kafka (KRaft) and Redis as plain processes.

Entry points: `python -m infra fetch|up|down|status|smoke`, and the modules
`infra.fetch`, `infra.kafka_broker`, `infra.redis_server`, `infra.procs`.
"""

from infra.errors import InfraError

__all__ = ["InfraError"]
