"""The warm-up's jobs: its own windowed job, or a running job's spec moved onto warm-up topics."""

from __future__ import annotations

from services.processor.warmup.topics import TOPIC_PREFIX
from shared import constants
from shared.jobspec import JobSpec, every_aggregation


def warmup_spec(tag: str) -> JobSpec:
    """A tumbling-window job with the common aggregations over the warm-up topic."""
    return JobSpec.model_validate(
        {
            "id": f"{constants.WARMUP_JOB_PREFIX}{tag}",
            "source": {
                "topic": f"{TOPIC_PREFIX}{tag}",
                "fields": {"page": "string", "latency": "double", "ts": "timestamp"},
                "key": ["page"],
                "event_time": {"field": "ts"},
            },
            "window": {"type": "tumbling", "size": "1s"},
            "watermark": {"max_out_of_orderness": "1s"},
            "aggregations": every_aggregation("latency"),
            "trigger_interval": "500ms",
            "output_topic": f"{TOPIC_PREFIX}{tag}.out",
        }
    )


def shaped_like(spec: JobSpec, tag: str) -> JobSpec | None:
    """The job ``spec`` on warm-up topics of its own under a warm-up id: the same plan, so the same
    generated code (Spark caches a compiled class by its source text). None for a join, whose two
    streams the warm-up does not make, and for a process job: its operator is Python code that would
    run on made-up events (and may dead-letter them)."""
    if spec.join is not None or spec.process is not None:
        return None
    topic = f"{TOPIC_PREFIX}{tag}"
    return spec.model_copy(
        update={
            "id": f"{constants.WARMUP_JOB_PREFIX}{tag}",
            "name": None,
            "source": spec.source.model_copy(update={"topic": topic}),
            "output_topic": f"{topic}.out",
        }
    )


def shape_of(spec: JobSpec) -> str:
    """What a job's plan depends on: its spec but for its id, name and topics."""
    shaped = shaped_like(spec, "x")
    return shaped.model_dump_json(by_alias=True) if shaped is not None else ""
