"""How a windowed job cuts event time: tumbling, sliding and session windows, and the watermark."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from shared.jobspec.base import DurationMs, SpecModel


class TumblingWindow(SpecModel):
    """Fixed-size, non-overlapping windows aligned to the epoch: [k*size, (k+1)*size)."""

    type: Literal["tumbling"] = "tumbling"
    size: DurationMs = Field(gt=0)


class SlidingWindow(SpecModel):
    """Windows of ``size`` starting every ``slide`` (aligned to the epoch); an event is in size/slide."""

    type: Literal["sliding"]
    size: DurationMs = Field(gt=0)
    slide: DurationMs = Field(gt=0)

    @model_validator(mode="after")
    def _slide_fits(self) -> SlidingWindow:
        if self.slide > self.size:
            raise ValueError(f"slide ({self.slide} ms) must not exceed size ({self.size} ms)")
        return self


class SessionWindow(SpecModel):
    """Per key, events closer than ``gap`` to the next form one session [first, last + gap)."""

    type: Literal["session"]
    gap: DurationMs = Field(gt=0)

    @property
    def size(self) -> int:
        """The shortest a session can be (a lone event's session is [t, t + gap))."""
        return self.gap


# The default idle timeout is never shorter than this: a shorter gap is an ordinary pause between events.
IDLE_TIMEOUT_FLOOR_MS = 1_000

Window = Annotated[TumblingWindow | SlidingWindow | SessionWindow, Field(discriminator="type")]


def window_type_default(value: Any) -> Any:
    """A window section with its ``type`` filled in: older specs leave it out for tumbling windows."""
    if isinstance(value, dict) and "type" not in value:
        return {**value, "type": "tumbling"}
    return value


class Watermark(SpecModel):
    """Bounded out-of-orderness plus allowed lateness, as Flink's WatermarkStrategy and allowedLateness.

    The processor gives Spark one watermark delay, ``max_out_of_orderness + allowed_lateness``: a
    window closes (and ``on_window_close`` emits it) once the largest event time seen minus that delay
    passes the window's end; an event whose every window has closed is dropped and counted. A stream
    silent for ``idle_timeout`` has its event time advanced by ingest (services/ingest/silence.py).
    """

    max_out_of_orderness: DurationMs = 5_000
    allowed_lateness: DurationMs = 0
    # Once every partition of the stream has been silent this long, event time follows processing
    # time from the last event time seen (never past now): windows close on a stream that stopped.
    # None: the out-of-orderness bound, at least IDLE_TIMEOUT_FLOOR_MS; 0: never.
    idle_timeout: DurationMs | None = None

    @property
    def delay_ms(self) -> int:
        return self.max_out_of_orderness + self.allowed_lateness

    @property
    def idle_timeout_ms(self) -> int:
        """How long a silent stream waits before its event time follows processing time; 0: never."""
        if self.idle_timeout is None:
            return max(self.max_out_of_orderness, IDLE_TIMEOUT_FLOOR_MS)
        return self.idle_timeout
