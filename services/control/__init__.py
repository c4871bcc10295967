"""Control: the REST API users drive the platform with, the gRPC service registry, and the supervisor
that starts, restarts and stops jobs on the processors."""
