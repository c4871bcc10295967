"""The processor's tracing: the sampled records' trace context, read by Spark SQL from Kafka headers.

The micro-batch span itself is built from the query listener's progress (services.processor.metrics)
with shared.tracing.record_batch_span.
"""

from __future__ import annotations

from datetime import datetime

from shared.tracing import MAX_BATCH_LINKS, TRACEPARENT

# With includeHeaders=true, Spark's Kafka source has a `headers` column: array<struct<key, value>>.
# spark_sampled_traceparent_sql() is the record's traceparent when it says "sampled", else NULL. It is
# plain SQL over arrays (no Python UDF, ANSI-safe), so it costs the JVM a header scan per record.
_SPARK_IS_SAMPLED = (
    "length(tp) = 55 AND substr(tp, 1, 3) = '00-' "
    "AND try_cast(conv(substr(tp, 54, 2), 16, 10) AS INT) % 2 = 1"
)
# Name of the observed metric (Dataset.observe) carrying a micro-batch's sampled traceparents.
SPARK_OBSERVATION = "sf_traces"


def spark_sampled_traceparent_sql(headers_column: str = "headers") -> str:
    """SQL for the sampled traceparent of a Kafka source row (use as F.expr(...).alias("traceparent"))."""
    values = (
        f"transform(filter({headers_column}, h -> h.key = '{TRACEPARENT}'), h -> CAST(h.value AS STRING))"
    )
    # The last traceparent header counts (as in header_value); it is kept only if it says "sampled".
    last = f"try_element_at({values}, -1)"
    return f"try_element_at(filter(array({last}), tp -> {_SPARK_IS_SAMPLED}), 1)"


def spark_observed_traceparents_sql(column: str = "traceparent", limit: int = MAX_BATCH_LINKS) -> str:
    """Aggregate for Dataset.observe: up to `limit` sampled traceparents of the micro-batch."""
    return f"slice(collect_list({column}), 1, {limit})"


def spark_progress_times(timestamp: str, duration_ms: float) -> tuple[int, int]:
    """(start, end) in ns of a micro-batch from StreamingQueryProgress.timestamp and its duration."""
    start = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    start_ns = int(start.timestamp() * 1_000_000) * 1000
    return start_ns, start_ns + int(duration_ms * 1_000_000)
