"""The SDK's fluent builder compiles to the same JobSpec as the shipped YAML specs."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.sdk import (
    Job,
    avg,
    count,
    max_,
    min_,
    percentiles,
    producer_config,
    session,
    sliding,
    stddev,
    sum_,
    tumbling,
)
from shared.errors import SpecError
from shared.jobspec import load_job_spec, parse_job_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "services" / "processor" / "examples"
CLICKS = {"page": "string", "user": "string", "ts": "timestamp", "latency_ms": "double"}


def test_word_count_builder_equals_the_shipped_spec() -> None:
    job = (
        Job("word-count")
        .source(
            "lines", fields={"doc": "string", "line": "string", "ts": "timestamp"}, key="doc", event_time="ts"
        )
        .flat_map("word", "explode(split(lower(line), '[^a-z]+'))")
        .filter("word <> ''")
        .key_by("word")
        .window(tumbling("10s"))
        .watermark("5s", allowed_lateness="0s")
        .aggregate(count(as_="count"))
        .having("count > 5")
        .emit("on_window_close")
        .trigger("1s")
        .to("aggregates")
    )
    assert job.build() == load_job_spec(EXAMPLES / "word_count.yaml")


def test_page_views_builder_equals_the_demo_spec() -> None:
    job = (
        Job("page-views")
        .source("clicks", fields=CLICKS, key=["page"], event_time="ts")
        .window(tumbling("10s"))
        .watermark("5s")
        .aggregate(count(as_="views"))
        .trigger("500ms")
    )
    assert job.build() == load_job_spec(EXAMPLES / "page_views.yaml")


def test_every_window_and_aggregation_helper_compiles() -> None:
    base = Job("sensors").source(
        "readings",
        fields={"sensor": "string", "value": "double", "ts": "timestamp"},
        key="sensor",
        event_time="ts",
    )
    spec = (
        base.window(sliding("30s", "10s"))
        .aggregate(avg("value"), min_("value"), max_("value"), sum_("value", as_="total"))
        .aggregate(stddev("value"), stddev("value", as_="sd_pop", population=True))
        .aggregate(percentiles("value", [50, 95], accuracy=1000), count())
        .build()
    )
    assert spec.window.model_dump() == {"type": "sliding", "size": 30_000, "slide": 10_000}
    assert spec.aggregate_names == [
        "avg_value",
        "min_value",
        "max_value",
        "total",
        "stddev_value",
        "sd_pop",
        "value_p50",
        "value_p95",
        "count",
    ]
    sessions = base.window(session("5s")).aggregate(count()).emit("on_window_close").build()
    assert sessions.window.model_dump() == {"type": "session", "gap": 5_000}


def test_builders_are_immutable_and_round_trip_through_yaml() -> None:
    base = Job("a").source("t", fields=CLICKS, key="page", event_time="ts")
    windowed = base.window(tumbling(5_000)).aggregate(count())
    assert "window" not in base.to_dict()
    assert parse_job_spec(windowed.to_yaml(), yaml_format=True) == windowed.build()
    both = base.filter("latency_ms > 10").filter("page <> '/'").to("alerts")
    assert both.build().filter == "(latency_ms > 10) AND (page <> '/')"
    assert both.build().kind == "stateless"


@pytest.mark.parametrize(
    ("job", "fragment"),
    [
        (Job("Bad Id"), "id"),
        (Job("no-source").window(tumbling("1s")), "source"),
        (
            Job("x").source("t", fields=CLICKS, key="nope", event_time="ts").window(tumbling("1s")),
            "key field(s) ['nope'] are not declared",
        ),
        (
            Job("x").source("t", fields=CLICKS, key="page", event_time="ts").window(tumbling("soon")),
            "'soon' is not a duration",
        ),
    ],
)
def test_a_bad_job_says_what_to_fix(job: Job, fragment: str) -> None:
    with pytest.raises(SpecError) as err:
        job.build()
    assert fragment in str(err.value)


def test_a_minted_producer_over_tls_trusts_the_ca_it_came_with() -> None:
    credential = {
        "bootstrap_servers": "10.9.0.2:9092",
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "username": "sf-producer-1",
        "password": "secret",
        "ssl_ca_pem": "-----BEGIN CERTIFICATE-----\n...",
    }
    conf = producer_config(credential, **{"linger.ms": 5})
    assert conf["security.protocol"] == "sasl_ssl"
    assert conf["ssl.ca.pem"] == credential["ssl_ca_pem"]
    assert conf["linger.ms"] == 5
    assert "ssl.ca.pem" not in producer_config({**credential, "ssl_ca_pem": ""})
