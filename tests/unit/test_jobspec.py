from __future__ import annotations

import re

import pytest

from shared.errors import SpecError
from shared.jobspec import JobSpec, load_job_spec, parse_duration_ms, parse_job_spec
from shared.settings import BaseServiceSettings

SPEC = """
id: clicks
source:
  topic: clicks
  fields: {page: string, ts: timestamp, amount: double}
  key: [page]
  event_time: {field: ts}
window: {type: tumbling, size: 10s}
aggregations: [{fn: count, as: views}]
"""


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("10s", 10_000), ("5m", 300_000), ("1h", 3_600_000), (" 2d ", 172_800_000), (250, 250)],
)
def test_durations(text: str | int, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("bad", ["10", "ten seconds", "-5s", -1, True, 1.5, "5 weeks"])
def test_bad_durations_say_what_a_duration_is(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration_ms(bad)


def test_yaml_spec_parses_with_defaults() -> None:
    spec = parse_job_spec(SPEC, yaml_format=True)
    assert spec.window.size == 10_000
    assert spec.watermark.max_out_of_orderness == 5_000
    assert spec.aggregations[0].name == "views"
    assert spec.source.valid_topic == "clicks.valid"
    assert spec.source.dlq_topic == "clicks.dlq"
    assert spec.output_topic == "aggregates"


def test_json_and_yaml_give_the_same_spec() -> None:
    spec = parse_job_spec(SPEC, yaml_format=True)
    assert parse_job_spec(spec.model_dump_json(by_alias=True)) == spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("key: [nope]", "key field(s) ['nope'] are not declared"),
        ("event_time: {field: page}", "must have type 'timestamp'"),
        ("event_time: {field: missing}", "is not declared in source.fields"),
    ],
)
def test_source_errors_name_the_problem(change: str, message: str) -> None:
    field = change.split(":")[0]
    lines = [("  " + change) if line.strip().startswith(field + ":") else line for line in SPEC.splitlines()]
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_job_spec("\n".join(lines), yaml_format=True)


def test_reserved_and_duplicate_aggregate_names_are_refused() -> None:
    with pytest.raises(SpecError, match="reserved"):
        parse_job_spec(SPEC.replace("as: views", "as: version"), yaml_format=True)
    dup = SPEC.replace("[{fn: count, as: views}]", "[{fn: count, as: n}, {fn: count, as: n}]")
    with pytest.raises(SpecError, match="unique"):
        parse_job_spec(dup, yaml_format=True)


def test_unknown_keys_and_bad_documents_are_refused() -> None:
    with pytest.raises(SpecError, match="exec: Extra inputs are not permitted"):
        parse_job_spec(SPEC + "\nexec: rm -rf /\n", yaml_format=True)
    with pytest.raises(SpecError, match="not valid JSON"):
        parse_job_spec("{oops")
    with pytest.raises(SpecError, match="mapping"):
        parse_job_spec("[1, 2]")


def test_missing_file_is_a_spec_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError, match="cannot read job spec"):
        load_job_spec(tmp_path / "nope.yaml")


def test_shipped_demo_spec_is_valid() -> None:
    from infra.paths import ROOT

    spec = load_job_spec(ROOT / "services/processor/examples/page_views.yaml")
    assert isinstance(spec, JobSpec) and spec.id == "page-views"


def test_settings_shared_and_service_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.ingest.settings import IngestSettings

    monkeypatch.setenv("SF_KAFKA_BOOTSTRAP", "broker:1234")
    monkeypatch.setenv("SF_INGEST_BATCH_MAX_RECORDS", "77")
    monkeypatch.setenv("SF_INGEST_JOB_SPECS", '["a.yaml", "b.yaml"]')
    s = IngestSettings()
    assert isinstance(s, BaseServiceSettings)
    assert (s.kafka_bootstrap, s.batch_max_records, s.job_specs) == ("broker:1234", 77, ["a.yaml", "b.yaml"])
