"""`make demo`: start everything, run the page-views job on 100k events, print its results.

Every run starts from a clean slate (the previous demo's stack is stopped and its data removed) so the
printed counts always equal the oracle's. The stack stays up afterwards; `make stop` ends it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from confluent_kafka import Consumer, Producer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infra.artifacts.fetch import kafka_classpath, spark_kafka_jars, zipkin_jar
from infra.demo.datagen import click_events, oracle_window_counts
from infra.errors import InfraError
from infra.local import procs
from infra.local.stack import (
    SERVICES,
    STANDBY_PROCESSOR,
    StackConfig,
    alertmanager,
    prometheus_server,
    start_infrastructure,
    start_monitoring,
    start_services,
    start_standby_processor,
)
from infra.paths import ROOT
from shared.jobspec import load_job_spec
from shared.kafka import KafkaAccess, ensure_topics
from shared.kafka_acl import PRODUCER, READER

SPEC_PATH = ROOT / "services" / "processor" / "examples" / "page_views.yaml"
EVENTS = 100_000
SPAN_MS = 120_000  # two minutes of event time: 12-13 ten-second windows
RESULT_TIMEOUT_S = 300

console = Console(soft_wrap=True)


def step(msg: str) -> None:
    console.print(f"[bold cyan]==>[/] {msg}")


def main() -> int:
    started = time.monotonic()
    # A fresh admin token per demo: control is never left open for writes, even on loopback.
    # The services start with no job: the demo submits its spec through the control API, as a user would.
    cfg = StackConfig(control_token=secrets.token_urlsafe(24))
    spec = load_job_spec(SPEC_PATH)
    token_file = cfg.run_dir / "control-token"
    try:
        step("stopping any previous demo and clearing its data")
        procs.stop_all(cfg.run_dir)
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        cfg.run_dir.mkdir(parents=True)
        token_file.write_text(cfg.control_token + "\n")
        token_file.chmod(0o600)
        step("Kafka, Spark-Kafka and Zipkin jars (from Maven Central once, then cached)")
        kafka_classpath()
        spark_kafka_jars()
        zipkin_jar()
        start_infrastructure(cfg, step)
        # One raw partition: the processor's watermark is global across partitions, so the demo's
        # raw stream keeps one order and out-of-order events stay within the watermark's bound.
        ensure_topics(cfg.kafka_access(), [spec.source.topic], partitions=1)
        write_client_configs(cfg, step)
        start_services(cfg, SERVICES, step)
        start_monitoring(cfg, step)
        submit_job(cfg, spec.id)
        if os.environ.get("SF_DEMO_STANDBY", "").lower() in ("1", "true", "yes"):
            # It warms up while the demo's data flows, then registers with control.
            step("starting a standby processor (takes over the job if the processor dies)")
            start_standby_processor(cfg, wait=False)
    except InfraError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 1

    now_ms = int(time.time() * 1000)
    start_ms = now_ms - now_ms % spec.window.size - SPAN_MS
    data = click_events(EVENTS, start_ms=start_ms, span_ms=SPAN_MS, bad_every=5_000)
    expected = oracle_window_counts(data.good, spec.window.size)
    produce(cfg.kafka_access(PRODUCER), spec.source.topic, data.records)
    got = wait_for_results(cfg, spec.id, expected)
    print_results(got, expected)
    dlq = count_records(cfg.kafka_access(READER), spec.source.dlq_topic)
    console.print(
        f"dead-letter topic {spec.source.dlq_topic}: {dlq} records (sent {len(data.bad)} malformed)"
    )
    print_processes(cfg)
    console.print(f"\n[bold]demo finished in {time.monotonic() - started:.0f} s[/]; the stack keeps running.")
    console.print(f"  control API   {cfg.control_url}")
    console.print(f"  API docs      {cfg.control_url}/docs")
    console.print(f"  results       {cfg.control_url}/jobs/{spec.id}/results")
    console.print(f"  Spark UI      http://127.0.0.1:{cfg.spark_ui_port}")
    console.print(f"  tracing UI    {cfg.zipkin_url}/zipkin/  (Zipkin)")
    auth = cfg.run_dir / "monitoring-auth" / "secrets.json"
    console.print(f"  Prometheus    {prometheus_server(cfg).url}  (user operator, password in {auth})")
    console.print(f"  Alertmanager  {alertmanager(cfg).url}  (user operator, same file)")
    if _serves(f"{cfg.control_url}/dashboard"):  # once control includes the dashboard router
        console.print(f"  dashboard     {cfg.control_url}/dashboard#token={cfg.control_token}")
    console.print(f"  logs          {cfg.run_dir / 'logs'}")
    console.print(f"  API token     {token_file}  (read+write; curl -H 'Authorization: Bearer ...')")
    console.print(f"  ingest token  {cfg.run_dir / 'ingest-token'}  (POST /v1/streams/<topic>/events)")
    console.print(f"  CLI           SF_CLI_TOKEN=$(cat {token_file}) .venv/bin/streamforge list")
    kafka = cfg.run_dir / "kafka"
    console.print(
        f"  Kafka         {cfg.bootstrap} (SASL/SCRAM): your clients' configs are {kafka}/client-*.properties"
    )
    console.print(
        f"                kcat -F {kafka}/client-reader.properties -C -t {spec.source.dlq_topic} -e"
    )
    console.print("  stop it all   make stop")
    ok = got == expected and dlq == len(data.bad)
    if not ok:
        console.print("[bold red]results differ from the oracle[/]")
    return 0 if ok else 1


def submit_job(cfg: StackConfig, job_id: str, timeout_s: float = 120) -> None:
    """POST the spec (YAML, as written) to control and wait until a processor runs it."""
    headers = {"Authorization": f"Bearer {cfg.control_token}"}
    with httpx.Client(base_url=cfg.control_url, timeout=30, headers=headers) as http:
        resp = http.post(
            "/jobs", content=SPEC_PATH.read_bytes(), headers={"Content-Type": "application/yaml"}
        )
        if resp.status_code >= 400:
            raise InfraError(f"control refused the demo job ({resp.status_code}): {resp.text}")
        step(f"submitted job {job_id} to the control API ({SPEC_PATH.relative_to(ROOT)})")
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            body = http.get(f"/jobs/{job_id}/status").json()
            state = body.get("state", "")
            if state == "RUNNING":
                step(f"job {job_id} RUNNING on {body.get('processor') or 'a processor'}")
                return
            if state in ("FAILED", "CANCELED"):
                raise InfraError(f"job {job_id} is {state}: {body.get('message')}")
            time.sleep(0.5)
    raise InfraError(f"job {job_id} not RUNNING within {timeout_s:.0f} s (last state {state or 'unknown'})")


def write_client_configs(cfg: StackConfig, step: Callable[[str], None]) -> None:
    """Client configs for users' own programs: ``producer`` writes raw topics, ``reader`` reads."""
    auth = cfg.kafka_auth()
    if auth is None:
        return
    directory = cfg.run_dir / "kafka"
    paths = [auth.client_properties(cfg.bootstrap, user, directory) for user in (PRODUCER, READER)]
    step(f"Kafka client configs: {', '.join(str(p) for p in paths)}")


def produce(kafka: KafkaAccess, topic: str, records: list[bytes]) -> None:
    producer = Producer({**kafka.config(), "linger.ms": 20, "enable.idempotence": True})
    with _progress() as bar:
        task = bar.add_task(f"producing to {topic}", total=len(records))
        for i, value in enumerate(records, 1):
            while True:
                try:
                    producer.produce(topic, value=value)
                    break
                except BufferError:  # local queue full: let deliveries drain, then retry
                    producer.poll(0.1)
            if i % 5_000 == 0:
                producer.poll(0)
                bar.update(task, completed=i)
        producer.flush(60)
        bar.update(task, completed=len(records))


def wait_for_results(
    cfg: StackConfig, job_id: str, expected: dict[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    total = sum(expected.values())
    got: dict[tuple[str, int], int] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    headers = {"Authorization": f"Bearer {cfg.control_token}"} if cfg.control_token else {}
    with _progress() as bar, httpx.Client(base_url=cfg.control_url, timeout=10, headers=headers) as http:
        task = bar.add_task("events in windows (Redis, via control API)", total=total)
        while time.monotonic() < deadline:
            resp = http.get(f"/jobs/{job_id}/results", params={"limit": 100_000})
            resp.raise_for_status()
            got = {(w["key"], w["window_start"]): w["aggregates"]["views"] for w in resp.json()["results"]}
            bar.update(task, completed=min(total, sum(got.values())))
            if got == expected:
                break
            time.sleep(1)
    return got


def print_results(got: dict[tuple[str, int], int], expected: dict[tuple[str, int], int]) -> None:
    keys = sorted({k for k, _ in expected})
    by_window: dict[int, dict[str, int]] = defaultdict(dict)
    for (key, start), n in got.items():
        by_window[start][key] = n
    table = Table(title="page-views: views per page, 10 s tumbling windows (event time, UTC)")
    table.add_column("window start")
    for k in keys:
        table.add_column(k, justify="right")
    table.add_column("total", justify="right", style="bold")
    for start in sorted(set(by_window) | {s for _, s in expected}):
        row = by_window.get(start, {})
        label = datetime.fromtimestamp(start / 1000, UTC).strftime("%H:%M:%S")
        table.add_row(label, *[str(row.get(k, 0)) for k in keys], str(sum(row.values())))
    console.print(table)
    matched = sum(1 for k, v in expected.items() if got.get(k) == v)
    verdict = "[green]equal to the oracle[/]" if got == expected else "[red]NOT equal to the oracle[/]"
    console.print(
        f"{matched}/{len(expected)} windows, {sum(got.values())}/{sum(expected.values())} events: {verdict}"
    )


def count_records(kafka: KafkaAccess, topic: str) -> int:
    consumer = Consumer(
        {
            **kafka.config(),
            "group.id": f"sf-demo-count-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    consumer.subscribe([topic])
    n, eof, deadline = 0, set(), time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is None:
                continue
            if m.error():
                eof.add(m.partition())
                parts = consumer.assignment()
                if parts and len(eof) >= len(parts):
                    break
                continue
            n += 1
    finally:
        consumer.close()
    return n


def _serves(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def print_processes(cfg: StackConfig) -> None:
    table = Table(title="processes")
    table.add_column("process")
    table.add_column("pid", justify="right")
    table.add_column("resident memory", justify="right")
    standby = [STANDBY_PROCESSOR] if procs.is_running(STANDBY_PROCESSOR, cfg.run_dir) else []
    for name in ("kafka", "redis", "zipkin", *SERVICES, *standby):
        pid = procs.pid_of(name, cfg.run_dir)
        rss = f"{procs.rss_mb(pid):.0f} MiB" if pid else "-"
        table.add_row(name, str(pid or "-"), rss)
    console.print(table)


def _progress() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


if __name__ == "__main__":
    sys.exit(main())
