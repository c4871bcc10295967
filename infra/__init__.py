"""Everything that fetches, builds and starts the platform; the services never import it.

    python -m infra setup|fetch|up|down|status|smoke|pki|cluster   (infra/__main__.py)

artifacts/  jars, Debian packages and the processor's JVM files, made once into .cache/
local/      Kafka, Redis, Zipkin and the services as processes on this machine (`make demo`, tests)
cluster/    three Kafka nodes, a Spark standalone cluster and service replicas (`make cluster`)
images/     container images (`make images`) and the Kubernetes manifests
demo/       `make demo` and the sample data's oracles
"""

from infra.errors import InfraError

__all__ = ["InfraError"]
