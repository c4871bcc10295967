"""Stream definitions: from job specs and a streams file, merged per raw topic."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.ingest.errors import StreamConfigError
from services.ingest.streams import (
    StreamDefinition,
    load_configured_streams,
    load_streams_file,
    merge_streams,
)

SOURCE = {
    "topic": "clicks",
    "fields": {"page": "string", "ts": "timestamp"},
    "key": ["page"],
    "event_time": {"field": "ts"},
}


def definition(**watermark: str) -> StreamDefinition:
    return StreamDefinition.model_validate({"source": SOURCE, "watermark": watermark})


def test_streams_file_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "streams.yaml"
    path.write_text(
        """
streams:
  - source:
      topic: orders
      fields: {id: string, at: timestamp, amount: double}
      key: [id]
      event_time: {field: at, format: iso8601}
    watermark: {max_out_of_orderness: 2s, allowed_lateness: 1m}
"""
    )
    [stream] = load_streams_file(path)
    assert stream.topic == "orders"
    assert stream.watermark.max_out_of_orderness == 2_000
    assert stream.watermark.allowed_lateness == 60_000


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("streams: [{source: {topic: x}}]", "fields"),
        ("streams: nope", "streams"),
        ("{unclosed", "not valid"),
        (
            "streams: [{source: {topic: x, fields: {a: string}, key: [a], event_time: {field: a}}}]",
            "timestamp",
        ),
    ],
)
def test_a_bad_streams_file_names_what_to_fix(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "streams.yaml"
    path.write_text(text)
    with pytest.raises(StreamConfigError, match=says):
        load_streams_file(path)


def test_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(StreamConfigError, match="cannot read"):
        load_streams_file(tmp_path / "absent.yaml")
    with pytest.raises(StreamConfigError, match="cannot read"):
        load_configured_streams([str(tmp_path / "absent.yaml")], "")


def test_job_specs_give_their_source_and_watermark(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        """
id: views
source: {topic: clicks, fields: {page: string, ts: timestamp}, key: [page], event_time: {field: ts}}
window: {type: tumbling, size: 10s}
watermark: {max_out_of_orderness: 3s, allowed_lateness: 1s}
"""
    )
    [stream] = load_configured_streams([str(spec)], "")
    assert stream.topic == "clicks"
    assert (stream.watermark.max_out_of_orderness, stream.watermark.allowed_lateness) == (3_000, 1_000)


def test_merge_keeps_the_most_lenient_watermark() -> None:
    merged = merge_streams(
        [
            definition(max_out_of_orderness="5s", allowed_lateness="0s"),
            definition(max_out_of_orderness="2s", allowed_lateness="10s"),
        ]
    )
    assert list(merged) == ["clicks"]
    assert merged["clicks"].watermark.max_out_of_orderness == 5_000
    assert merged["clicks"].watermark.allowed_lateness == 10_000


def test_merge_refuses_two_schemas_for_one_topic() -> None:
    other = StreamDefinition.model_validate({"source": {**SOURCE, "key": ["ts"]}})
    with pytest.raises(StreamConfigError, match="clicks"):
        merge_streams([definition(), other])


def test_a_join_job_gives_both_of_its_streams(tmp_path: Path) -> None:
    spec = tmp_path / "join.yaml"
    spec.write_text(
        """
id: clicks-with-orders
source: {topic: clicks, fields: {page: string, ts: timestamp}, key: [page], event_time: {field: ts}}
join:
  source: {topic: orders, fields: {page: string, at: timestamp}, key: [page], event_time: {field: at}}
  within: 1m
watermark: {max_out_of_orderness: 4s}
output_topic: clicks-with-orders
"""
    )
    streams = load_configured_streams([str(spec)], "")
    assert [s.topic for s in streams] == ["clicks", "orders"]
    assert {s.watermark.max_out_of_orderness for s in streams} == {4_000}
