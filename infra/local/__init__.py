"""The platform on one machine, as plain processes: a Kafka broker, Redis, Zipkin and the services.

procs.py starts, tracks (pid files) and stops them; kafka_broker.py, redis_server.py and zipkin.py run
one of each; stack.py starts the whole stack (`make demo`, the end-to-end tests); smoke.py checks a
running broker and Redis.
"""
