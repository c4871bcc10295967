from __future__ import annotations

import re

import orjson
import pytest

from shared.errors import SpecError
from shared.jobspec import (
    JobSpec,
    SessionWindow,
    SlidingWindow,
    TumblingWindow,
    load_job_spec,
    parse_duration_ms,
    parse_job_spec,
    spec_from_json,
    spec_to_json,
    with_id,
)
from shared.settings import BaseServiceSettings, redacted_url

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
    monkeypatch.setenv("SF_INGEST_MAX_RECORD_BYTES", "77")
    monkeypatch.setenv("SF_INGEST_JOB_SPECS", '["a.yaml", "b.yaml"]')
    monkeypatch.setenv("SF_INGEST_TUNING", '{"batch_max_records": 78}')
    s = IngestSettings()
    assert isinstance(s, BaseServiceSettings)
    assert (s.kafka_bootstrap, s.max_record_bytes, s.job_specs) == ("broker:1234", 77, ["a.yaml", "b.yaml"])
    assert s.tuning.batch_max_records == 78


# --- job kinds, windows, aggregations, emit policies ---------------------------------------------------
def spec_dict(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "id": "j",
        "source": {
            "topic": "clicks",
            "fields": {"page": "string", "ts": "timestamp", "amount": "double", "flag": "boolean"},
            "key": ["page"],
            "event_time": {"field": "ts"},
        },
        "window": {"type": "tumbling", "size": "10s"},
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def parse(**changes: object) -> JobSpec:
    return parse_job_spec(orjson.dumps(spec_dict(**changes)))


def test_every_window_type_parses_and_tumbling_needs_no_type() -> None:
    assert parse(window={"size": "5s"}).window == TumblingWindow(size=5_000)
    sliding = parse(window={"type": "sliding", "size": "30s", "slide": "10s"}).window
    assert isinstance(sliding, SlidingWindow) and (sliding.size, sliding.slide) == (30_000, 10_000)
    session = parse(window={"type": "session", "gap": "2s"}, emit="on_window_close").window
    assert isinstance(session, SessionWindow) and session.gap == 2_000


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window": {"type": "session", "gap": "2s"}}, "session windows need emit: on_window_close"),
        ({"window": {"type": "sliding", "size": "5s", "slide": "10s"}}, "must not exceed size"),
        ({"window": {"type": "hopping", "size": "5s"}}, "window"),
        ({"dedup": {"fields": ["page"]}}, "dedup before a window needs emit: on_window_close"),
        (
            {
                "trigger_mode": "real_time",
                "window": {"type": "session", "gap": "2s"},
                "emit": "on_window_close",
            },
            "does not run session windows",
        ),
        ({"trigger_mode": "real_time", "emit": "on_window_close"}, "real_time needs emit: on_update"),
        (
            {"trigger_mode": "real_time", "dedup": {"fields": ["page"]}, "emit": "on_window_close"},
            "no dedup or stream-stream join",
        ),
        ({"aggregations": [{"fn": "sum", "field": "page"}]}, "needs a long or double field"),
        ({"aggregations": [{"fn": "avg"}]}, "needs a 'field'"),
        (
            {"aggregations": [{"fn": "percentiles", "field": "amount", "percentiles": [100]}]},
            "between 0 and 100",
        ),
        ({"aggregations": [{"fn": "percentiles", "field": "amount"}]}, "non-empty list"),
        ({"aggregations": [{"fn": "max", "field": "amount", "percentiles": [5]}]}, "only applies to fn"),
        ({"aggregations": [{"fn": "count", "field": "nope"}]}, "not a source or derived field"),
        ({"aggregations": []}, "at least one aggregation"),
        ({"group_by": ["nope"]}, "group_by field 'nope'"),
        ({"derive": {"page": "upper(page)"}}, "already exists"),
        ({"derive": {"__x": "1"}}, "not starting with '__'"),
        ({"filter": ""}, "filter"),
        ({"window": None, "aggregations": [{"fn": "count"}]}, "aggregations need a window"),
        ({"window": None, "having": "n > 1"}, "'having' only applies to windowed jobs"),
        ({"window": None, "emit": "on_window_close"}, "'emit' only applies to windowed jobs"),
        ({"window": None}, "give it its own output_topic"),
    ],
)
def test_refusals_name_what_to_fix(changes: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse(**changes)


def test_aggregation_names_defaults_and_percentile_outputs() -> None:
    spec = parse(
        aggregations=[
            {"fn": "count"},
            {"fn": "count", "field": "amount"},
            {"fn": "avg", "field": "amount"},
            {"fn": "percentiles", "field": "amount", "percentiles": [50, 95, 99.9], "accuracy": 500},
            {"fn": "stddev", "field": "amount", "as": "sd"},
        ]
    )
    assert spec.aggregate_names == [
        "count",
        "count_amount",
        "avg_amount",
        "amount_p50",
        "amount_p95",
        "amount_p99_9",
        "sd",
    ]
    assert spec.aggregations[3].accuracy == 500 and spec.aggregations[0].accuracy == 10_000
    assert spec.has_percentiles  # its groups keep objects: the processor bounds its tasks and state
    assert not parse(aggregations=[{"fn": "count"}, {"fn": "stddev", "field": "amount"}]).has_percentiles
    with pytest.raises(SpecError, match="unique"):
        parse(
            aggregations=[
                {"fn": "percentiles", "field": "amount", "percentiles": [50]},
                {"fn": "count", "as": "amount_p50"},
            ]
        )


def test_job_kinds_and_their_sources() -> None:
    windowed = parse()
    assert (windowed.kind, windowed.key_fields, windowed.aggregate_names) == ("windowed", ["page"], ["count"])
    stateless = parse(window=None, filter="amount > 1", derive={"big": "amount * 2"}, output_topic="big")
    assert stateless.kind == "stateless" and stateless.aggregations == []
    with pytest.raises(SpecError, match="stateless job: it has no window"):
        _ = stateless.window
    realtime = parse(window=None, output_topic="o", trigger_mode="real_time", trigger_interval="5s")
    assert (realtime.trigger_mode, realtime.trigger_interval) == ("real_time", 5_000)
    dedup = parse(window=None, dedup={"fields": ["page"]}, output_topic="o")
    assert dedup.kind == "dedup"
    right = {
        "topic": "pay",
        "fields": {"page": "string", "ts": "timestamp"},
        "key": ["page"],
        "event_time": {"field": "ts"},
    }
    join = parse(
        window=None,
        join={"source": right, "within": "30s", "prefix": "p_"},
        output_topic="o",
        filter="p_page = page",
    )
    assert join.kind == "join" and [s.topic for s in join.sources] == ["clicks", "pay"]
    assert join.input_fields_before_derive[-2:] == ["p_page", "p_ts"]
    grouped = parse(derive={"word": "explode(split(page, '/'))"}, group_by=["word"], having="count > 1")
    assert grouped.key_fields == ["word"]


@pytest.mark.parametrize(
    ("join", "message"),
    [
        ({"key": ["page", "ts"]}, "must pair up one to one"),
        ({"fields": {"page": "long", "ts": "timestamp"}}, "differ in type"),
        ({"topic": "clicks"}, "must be different topics"),
    ],
)
def test_join_refusals(join: dict[str, object], message: str) -> None:
    right = {
        "topic": "pay",
        "fields": {"page": "string", "ts": "timestamp"},
        "key": ["page"],
        "event_time": {"field": "ts"},
    }
    with pytest.raises(SpecError, match=re.escape(message)):
        parse(window=None, join={"source": {**right, **join}, "within": "5s"}, output_topic="o")
    with pytest.raises(SpecError, match="cannot also have a window"):
        parse(join={"source": right, "within": "5s"})


def test_every_spec_round_trips_through_json() -> None:
    from infra.paths import ROOT

    for path in sorted((ROOT / "services/processor/examples").glob("*.yaml")):
        spec = load_job_spec(path)
        assert parse_job_spec(spec_to_json(spec)) == spec, path.name
        assert JobSpec.model_validate(spec.model_dump(mode="json", by_alias=True)) == spec, path.name


def test_a_spec_text_is_parsed_once_and_renamed_with_validation() -> None:
    spec = parse_job_spec(SPEC, yaml_format=True)
    text = spec_to_json(spec)
    assert spec_from_json(text) == spec
    assert spec_from_json(text) is spec_from_json(text)  # the same text is not parsed again
    with pytest.raises(SpecError, match="not valid JSON"):
        spec_from_json("{not json")
    renamed = with_id(spec, "clicks-b")
    assert renamed.id == "clicks-b" and renamed.model_copy(update={"id": "clicks"}) == spec
    assert with_id(spec, spec.id) is spec
    with pytest.raises(SpecError, match="id"):
        with_id(spec, "Not An Id")


def test_shipped_examples_cover_every_job_kind() -> None:
    from infra.paths import ROOT

    specs = {p.stem: load_job_spec(p) for p in (ROOT / "services/processor/examples").glob("*.yaml")}
    assert {s.kind for s in specs.values()} == {"windowed", "stateless", "dedup", "join"}
    assert (
        specs["word_count"].derive
        and specs["word_count"].having
        and specs["word_count"].emit == "on_window_close"
    )
    assert isinstance(specs["sensor_readings"].window, SlidingWindow)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"output_topic": "__consumer_offsets"}, "Kafka's internal topics"),
        ({"output_topic": "__transaction_state"}, "Kafka's internal topics"),
        ({"output_topic": "clicks"}, "one of this job's own input topics"),
        ({"output_topic": "clicks.valid"}, "one of this job's own input topics"),
        ({"output_topic": "clicks.dlq"}, "one of this job's own input topics"),
    ],
)
def test_output_topics_that_would_inject_into_kafka_or_the_jobs_own_input_are_refused(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse(**changes)


def test_a_source_topic_may_not_be_internal() -> None:
    source = dict(spec_dict()["source"])  # type: ignore[call-overload]
    source["topic"] = "__consumer_offsets"
    with pytest.raises(SpecError, match="Kafka's internal topics"):
        parse(source=source)


@pytest.mark.parametrize("depth", [40, 900, 50_000])
def test_yaml_nested_too_deep_is_a_spec_error_not_a_crash(depth: int) -> None:
    """PyYAML's constructor recursed (RecursionError at ~900) and libyaml's crashed the process
    (~50,000): the depth is checked on the parser's events first."""
    text = "id: x\nsource: " + "[" * depth + "]" * depth
    with pytest.raises(SpecError, match="nests deeper than 32 levels"):
        parse_job_spec(text, yaml_format=True)


def test_real_time_runs_tumbling_and_sliding_windows_emitted_on_update() -> None:
    for window in ({"type": "tumbling", "size": "10s"}, {"type": "sliding", "size": "10s", "slide": "5s"}):
        spec = parse(window=window, trigger_mode="real_time", trigger_interval="5s")
        assert spec.trigger_mode == "real_time" and spec.emit == "on_update"


def test_the_throughput_profile_changes_tuning_and_an_explicit_value_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.ingest.settings import IngestSettings
    from services.sink.settings import SinkSettings

    assert SinkSettings().commit_interval_s == 0.1 and IngestSettings().tuning.batch_linger_ms == 5
    monkeypatch.setenv("SF_PROFILE", "throughput")
    assert SinkSettings().commit_interval_s == 1.0 and SinkSettings().tuning.batch_linger_ms == 50
    assert IngestSettings().tuning.batch_linger_ms == 100
    # An explicit value wins over the profile: a public setting, and a tuning override.
    monkeypatch.setenv("SF_SINK_COMMIT_INTERVAL_MS", "250")
    monkeypatch.setenv("SF_INGEST_TUNING", orjson.dumps({"batch_linger_ms": 7}).decode())
    assert SinkSettings().commit_interval_s == 0.25 and SinkSettings().tuning.batch_linger_ms == 50
    ingest = IngestSettings().tuning
    assert (ingest.batch_linger_ms, ingest.batch_max_records) == (7, 20_000)


def test_a_logged_redis_url_never_shows_its_password() -> None:
    assert redacted_url("redis://sink:s3cret@127.0.0.1:6379/0") == "redis://sink:***@127.0.0.1:6379/0"
    assert redacted_url("redis://:s3cret@localhost/1") == "redis://:***@localhost/1"
    assert redacted_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_real_time_job_without_a_trigger_interval_checkpoints_every_30_s_not_every_second() -> None:
    spec = spec_dict()
    spec.pop("trigger_interval", None)
    assert parse_job_spec(orjson.dumps({**spec, "trigger_mode": "real_time"})).trigger_interval == 30_000
    assert parse_job_spec(orjson.dumps(spec)).trigger_interval == 500  # micro-batch: its own default
