"""What the warm-up reports of its throwaway job (services/processor/warmup.py)."""

from __future__ import annotations

from services.processor.warmup import events_read


def test_the_events_read_are_the_sources_end_offsets_however_many_reports_spark_kept() -> None:
    # Spark's progress JSON gives a Kafka source's offsets as an object (parsed) or, from some
    # sources, as the JSON text; the warm-up's topic is new, so its end offsets count its events.
    progress = {
        "batchId": 250,  # past the 100 reports recentProgress keeps: a sum over those would undercount
        "numInputRows": 412,
        "sources": [{"endOffset": {"_sf-warmup-x.valid": {"0": 312_345}}}],
    }
    assert events_read(progress) == 312_345
    as_text = {"sources": [{"endOffset": '{"_sf-warmup-x.valid": {"0": 7, "1": 5}}'}]}
    assert events_read(as_text) == 12
    assert events_read(None) == 0  # no batch ran
    assert events_read({"sources": [{"endOffset": None}]}) == 0
