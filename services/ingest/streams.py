"""Stream definitions: what ingest applies per raw topic (schema, key, event time, watermark).

They come from job specs (their `source`, `join.source` and `watermark` sections), from a streams
file, and at run time from the control plane (gRPC StreamConfig.ApplyStreams, which sends job specs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from services.ingest.errors import StreamConfigError
from services.ingest.watermark import IdlePolicy
from shared.errors import SpecError
from shared.jobspec import JobSpec, Source, Watermark, load_job_spec
from shared.operators import timer_reach_ms


class StreamDefinition(BaseModel):
    """One stream: its raw topic's events (``source``) and how late they may be (``watermark``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Source
    watermark: Watermark = Watermark()
    # Per job reading the stream: its idle timeout (0: off); empty: the watermark's (a streams file).
    idle_timeouts: tuple[int, ...] = ()
    # How far past the last event time its jobs' windows (or operators' timers) reach, the watermark
    # delay included.
    horizon_ms: int = 0

    @property
    def topic(self) -> str:
        return self.source.topic

    @classmethod
    def of_job(cls, spec: JobSpec) -> list[StreamDefinition]:
        """Every stream a job reads (a join reads two), each with the job's watermark."""
        # A window closes at its end; an operator's timers fire as far past a key's last event as it says.
        reach = spec.windowing.size if spec.windowing is not None else timer_reach_ms(spec)
        return [
            cls(
                source=source,
                watermark=spec.watermark,
                idle_timeouts=(spec.watermark.idle_timeout_ms,),
                horizon_ms=reach + spec.watermark.delay_ms,
            )
            for source in spec.sources
        ]

    def timeouts(self) -> tuple[int, ...]:
        return self.idle_timeouts or (self.watermark.idle_timeout_ms,)

    def idle_policy(self) -> IdlePolicy:
        """When ingest advances the stream's event time while it is silent (watermark.IdlePolicy):
        each job takes the advances past its own timeout; ingest's late rule, the most lenient job's."""
        timeouts = self.timeouts()
        on = [t for t in timeouts if t > 0]
        if not on:
            return IdlePolicy()
        lenient = max(on) if len(on) == len(timeouts) else 0
        return IdlePolicy(min(on), max(on), lenient, max(self.horizon_ms, self.watermark.delay_ms))


@dataclass
class StreamsUpdate:
    """A new set of stream definitions, handed from a gRPC thread to the loop that owns the consumer."""

    streams: dict[str, StreamDefinition]
    done: threading.Event
    error: Exception | None = None


def family_topics(streams: Iterable[StreamDefinition]) -> list[str]:
    """Every topic of these streams: raw, valid, dead-letter and late."""
    return [
        t for d in streams for t in (d.topic, d.source.valid_topic, d.source.dlq_topic, d.source.late_topic)
    ]


class StreamsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    streams: list[StreamDefinition]


def load_streams_file(path: str | Path) -> list[StreamDefinition]:
    """Read ``streams: [{source: ..., watermark: ...}]`` from a .yaml/.yml/.json file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise StreamConfigError(f"cannot read streams file {p}: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else orjson.loads(text)
    except (yaml.YAMLError, orjson.JSONDecodeError) as e:
        raise StreamConfigError(f"streams file {p} is not valid YAML/JSON: {e}") from e
    try:
        return list(StreamsFile.model_validate(raw).streams)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '<file>'}: {err['msg']}" for err in e.errors()
        )
        raise StreamConfigError(f"invalid streams file {p}: {problems}") from e


def load_configured_streams(job_specs: Iterable[str], streams_file: str) -> list[StreamDefinition]:
    """The streams of the settings: every job spec's stream, then the streams file's."""
    try:
        found = [d for p in job_specs for d in StreamDefinition.of_job(load_job_spec(p))]
    except SpecError as e:
        raise StreamConfigError(str(e)) from e
    if streams_file:
        found += load_streams_file(streams_file)
    return found


def merge_streams(definitions: Iterable[StreamDefinition]) -> dict[str, StreamDefinition]:
    """One definition per raw topic.

    Several jobs may read one raw topic: their sources must agree (ingest normalises each record
    once), while their watermarks may differ. Ingest then applies the most lenient bounds, so it
    never sends to the late topic an event that one of the jobs would still accept; each job's
    query applies its own watermark downstream (and takes a silent stream's advances past its own
    idle timeout).
    """
    merged: dict[str, StreamDefinition] = {}
    for d in definitions:
        seen = merged.get(d.topic)
        if seen is None:
            merged[d.topic] = d
            continue
        if seen.source != d.source:
            raise StreamConfigError(
                f"raw topic {d.topic!r} is defined twice with different sources (fields, key or "
                "event time): one topic has one schema"
            )
        merged[d.topic] = StreamDefinition(
            source=seen.source,
            watermark=Watermark(
                max_out_of_orderness=max(
                    seen.watermark.max_out_of_orderness, d.watermark.max_out_of_orderness
                ),
                allowed_lateness=max(seen.watermark.allowed_lateness, d.watermark.allowed_lateness),
            ),
            idle_timeouts=(*seen.timeouts(), *d.timeouts()),
            horizon_ms=max(seen.horizon_ms, seen.watermark.delay_ms, d.horizon_ms, d.watermark.delay_ms),
        )
    return merged
