"""`make cluster`: the platform past one process per service, on this machine.

topology.py lays out and starts it: three Kafka nodes (kafka_cluster.py), a Spark standalone master
and workers (spark_standalone.py), Redis, control and replicas of the other services.
"""
