"""What the warm-up reports of its throwaway job (services/processor/warmup.py)."""

from __future__ import annotations

import time

from services.processor.warmup import events_read, fill_backlog


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


def test_the_backlog_stops_at_its_deadline_and_counts_only_what_was_sent() -> None:
    # No broker at this address: librdkafka queues what it can (100,000 messages, then BufferError)
    # and delivers nothing. Without the deadline the write ran until all 300,000 were queued and then
    # waited 30 s for them: the warm-up outlasted its time on a loaded machine.
    began = time.monotonic()
    sent = fill_backlog("127.0.0.1:1", "_sf-warmup-x.valid", 300_000, 1_000_000, deadline=began + 1)
    assert sent == 0
    assert time.monotonic() - began < 10  # the deadline, plus the purge's 1 s and a loaded machine's slack
