"""Sink: consumes window results and writes them to Redis as versioned, idempotent upserts."""
