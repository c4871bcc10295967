"""The processor's tracing: the sampled records' trace context, read by Spark SQL from Kafka headers.

The micro-batch span itself is built from the query listener's progress (services.processor.metrics)
with shared.tracing.record_batch_span.
"""

from __future__ import annotations

from datetime import datetime

from shared.tracing import MAX_BATCH_LINKS, TRACEPARENT

# Whether a traceparent `tp` says "sampled": plain SQL (no Python UDF, ANSI-safe), so a record costs
# the JVM only a header scan. W3C: lowercase hex throughout (spark_trace_numbers reads the parts as
# hex numbers).
_SPARK_IS_SAMPLED = (
    "length(tp) = 55 AND tp RLIKE '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' "
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


# How a window's sampled trace context is kept in its state (the checkpoint's note says which).
# TRACE_NUMBERS: the traceparent's parts as four longs (fixed-width: Spark aggregates by hash);
# TRACE_TEXT: the max of the string (checkpoints of before, and jobs with percentiles: jobs/plan.py).
TRACE_NUMBERS = "numbers"
TRACE_TEXT = "text"
# (name suffix, first character, length) of a traceparent's parts: 00-<trace id>-<span id>-<flags>.
_TRACEPARENT_PARTS = (("trace_hi", 4, 16), ("trace_lo", 20, 16), ("span", 37, 16), ("flags", 54, 2))


def spark_trace_numbers(column: str, prefix: str) -> list[tuple[str, str]]:
    """(name, SQL) of the four longs of a sampled traceparent column (NULL stays NULL): hex read as
    signed 64-bit (conv to base -10), so the ids' high bit round-trips through hex()."""
    return [
        (f"{prefix}{name}", f"CAST(conv(substr({column}, {start}, {length}), 16, -10) AS BIGINT)")
        for name, start, length in _TRACEPARENT_PARTS
    ]


def spark_traceparent_of_numbers(prefix: str) -> str:
    """SQL: the traceparent the four columns of spark_trace_numbers(_, prefix) hold (NULL if none).

    hex() writes A-F; translate() makes them lowercase. Not lower(): Spark 4 maps case through ICU
    (spark.sql.icu.caseMappings.enabled), and the first such call in a JVM builds a table over every
    code point, a cost inside the first batch of every start, restart and takeover."""
    hi, lo, span, flags = (
        f"translate(lpad(hex({prefix}{name}), {n}, '0'), 'ABCDEF', 'abcdef')"
        for name, _, n in _TRACEPARENT_PARTS
    )
    return f"concat('00-', {hi}, {lo}, '-', {span}, '-', {flags})"


def spark_observed_traceparents_sql(column: str = "traceparent", limit: int = MAX_BATCH_LINKS) -> str:
    """Aggregate for Dataset.observe: up to `limit` sampled traceparents of the micro-batch."""
    return f"slice(collect_list({column}), 1, {limit})"


def spark_progress_times(timestamp: str, duration_ms: float) -> tuple[int, int]:
    """(start, end) in ns of a micro-batch from StreamingQueryProgress.timestamp and its duration."""
    start = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    start_ns = int(start.timestamp() * 1_000_000) * 1000
    return start_ns, start_ns + int(duration_ms * 1_000_000)
