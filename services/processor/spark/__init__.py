"""Spark's JVM as the processor runs it: the session, scheduler internals, scratch space, class archive."""
