"""The Spark settings the processor derives from its own (services/processor/app.py, session_conf)."""

from __future__ import annotations

import pytest

from services.processor.app import REALTIME_SHUFFLE_FLUSH, session_conf
from services.processor.settings import ProcessorSettings


def test_the_real_time_shuffle_flushes_within_5_ms_unless_the_profile_is_throughput(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert session_conf(ProcessorSettings())[REALTIME_SHUFFLE_FLUSH] == "5"
    monkeypatch.setenv("SF_PROFILE", "throughput")
    assert session_conf(ProcessorSettings())[REALTIME_SHUFFLE_FLUSH] == "50"  # Spark's own default
    monkeypatch.setenv("SF_PROCESSOR_REALTIME_SHUFFLE_FLUSH_MS", "20")  # explicit wins over the profile
    assert session_conf(ProcessorSettings())[REALTIME_SHUFFLE_FLUSH] == "20"


def test_spark_conf_given_explicitly_wins_over_the_derived_settings() -> None:
    settings = ProcessorSettings(realtime_shuffle_flush_ms=5, spark_conf={REALTIME_SHUFFLE_FLUSH: "1"})
    assert session_conf(settings)[REALTIME_SHUFFLE_FLUSH] == "1"
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ProcessorSettings(realtime_shuffle_flush_ms=0)
