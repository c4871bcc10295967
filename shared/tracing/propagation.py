"""W3C trace context in Kafka headers: how a record carries its trace from one service to the next."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

KafkaHeaders = Sequence[tuple[str, Any]] | None
"""Kafka headers as confluent-kafka gives them (list of (key, bytes)); Spark's ``headers`` column rows
(key, value) have the same shape."""

PROPAGATOR = TraceContextTextMapPropagator()


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    return None


def header_value(headers: KafkaHeaders, name: str) -> str | None:
    """Text of the last header called `name` (Kafka allows repeats; the last one wins), or None."""
    if not headers:
        return None
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return None if found is None else _text(found)


def is_sampled_traceparent(traceparent: str) -> bool:
    """True for a well-formed version-00 traceparent whose sampled flag is set."""
    if len(traceparent) != 55 or not traceparent.startswith("00-"):
        return False
    try:
        return int(traceparent[53:55], 16) & 1 == 1
    except ValueError:
        return False


def sampled_traceparent(headers: KafkaHeaders) -> str | None:
    """The record's traceparent if it says "sampled", else None: the cheap per-record check."""
    traceparent = header_value(headers, TRACEPARENT)
    if traceparent is None or not is_sampled_traceparent(traceparent):
        return None
    return traceparent


def extract_context(kafka_headers: KafkaHeaders) -> Context:
    """The trace context a record carries (an empty Context when it carries none or a malformed one)."""
    carrier: dict[str, str] = {}
    for name in (TRACEPARENT, TRACESTATE):
        value = header_value(kafka_headers, name)
        if value is not None:
            carrier[name] = value
    return PROPAGATOR.extract(carrier) if carrier else Context()


def context_from_traceparent(traceparent: str, tracestate: str | None = None) -> Context:
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    return PROPAGATOR.extract(carrier)


def inject_headers(
    headers: KafkaHeaders = None, context: Context | None = None
) -> list[tuple[str, str | bytes | None]]:
    """`headers` plus the trace context (of the current span, or `context`), replacing any older one.

    Returns a new list for Producer.produce(headers=...). Nothing is added when there is no valid span.
    """
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=context)
    kept = [(k, v) for k, v in (headers or ()) if not (carrier and k in (TRACEPARENT, TRACESTATE))]
    return kept + [(k, v.encode()) for k, v in carrier.items()]


def current_traceparent() -> str | None:
    """The traceparent of the current span (None when there is none), e.g. for a Spark output header."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT)
