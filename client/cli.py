"""`streamforge`: the command line for the control API (jobs, results, services) and Kafka topics.

`streamforge --help` lists the commands. Where it connects: --url / SF_CLI_URL, --token /
SF_CLI_TOKEN, and --bootstrap / SF_KAFKA_BOOTSTRAP for tail and produce.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer
from confluent_kafka import Consumer, KafkaError, Producer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from client.sdk import Client, ClientError, producer_config
from client.settings import CliSettings
from shared.errors import StreamForgeError
from shared.jobspec import JobSpec, load_job_spec, parse_job_spec, spec_to_json
from shared.kafka import read_properties

app = typer.Typer(
    name="streamforge",
    help="Drive StreamForge: submit and watch jobs, read results, inspect services, tail and feed topics.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
# How long one call to the control API may take: a submit, cancel or savepoint waits there for the
# processor's answer, so this outlasts control's own wait.
REQUEST_TIMEOUT_S = 60.0

STATE_STYLE = {
    "CREATED": "cyan",
    "RUNNING": "green",
    "FAILING": "yellow",
    "FAILED": "red",
    "CANCELLING": "yellow",
    "CANCELED": "dim",
    "FINISHED": "blue",
}


class _Options:
    url: str | None = None
    token: str | None = None
    bootstrap: str | None = None
    kafka_config: str | None = None


_opts = _Options()


@app.callback()
def main(
    url: Annotated[
        str | None, typer.Option(help="control API URL, or a comma-separated list of replicas [SF_CLI_URL]")
    ] = None,
    token: Annotated[str | None, typer.Option(help="bearer token [SF_CLI_TOKEN]")] = None,
    bootstrap: Annotated[str | None, typer.Option(help="Kafka bootstrap [SF_KAFKA_BOOTSTRAP]")] = None,
    kafka_config: Annotated[
        str | None, typer.Option(help="librdkafka properties file for tail/produce [SF_CLI_KAFKA_CONFIG]")
    ] = None,
) -> None:
    _opts.url, _opts.token, _opts.bootstrap, _opts.kafka_config = url, token, bootstrap, kafka_config


def _settings() -> CliSettings:
    return CliSettings()


def _client() -> Client:
    s = _settings()
    token = _opts.token or (s.token.get_secret_value() if s.token else None)
    return Client(_opts.url or s.url, token, timeout_s=REQUEST_TIMEOUT_S)


def _kafka_config() -> dict[str, Any]:
    """Where Kafka is and who we are there: a properties file, else the SF_KAFKA_* settings."""
    s = _settings()
    path = _opts.kafka_config or s.kafka_config
    conf: dict[str, Any] = read_properties(path) if path else dict(s.kafka().config())
    if _opts.bootstrap:
        conf["bootstrap.servers"] = _opts.bootstrap
    return conf


def _fail(e: Exception) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(e))}")
    return typer.Exit(1)


@contextmanager
def _control(busy: str = "") -> Iterator[Client]:
    """A client of the control API, with a spinner saying ``busy`` if given; a StreamForgeError
    raised inside ends the command with its message and exit code 1."""
    try:
        with _client() as client, console.status(busy) if busy else nullcontext():
            yield client
    except StreamForgeError as e:
        raise _fail(e) from None


def _state(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{state}[/]"


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _show_status(job: dict[str, Any]) -> None:
    console.print(f"[bold]{escape(job['id'])}[/] {_state(job['state'])}  {escape(job.get('message', ''))}")
    if job.get("processor"):
        console.print(f"  processor      {escape(job['processor'])}")
    if job.get("savepoint_path"):
        console.print(f"  savepoint      {escape(job['savepoint_path'])}")
    if job.get("from_savepoint"):
        console.print(f"  from savepoint {escape(job['from_savepoint'])}")
    console.print(f"  restarts {job.get('restarts', 0)}, recoveries {job.get('recoveries', 0)}")


# --- jobs ---------------------------------------------------------------------------------------------
@app.command()
def submit(
    spec: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="job spec (.yaml/.yml/.json)")],
    from_savepoint: Annotated[str, typer.Option(help="start from this savepoint path")] = "",
    wait: Annotated[bool, typer.Option(help="wait for the processor's answer")] = True,
    parallelism: Annotated[
        int | None, typer.Option(min=1, help="task slots the job reserves (overrides the spec's)")
    ] = None,
) -> None:
    """Submit a job spec; it runs on a live processor (or waits CREATED for one)."""
    job_spec: Path | JobSpec = spec
    if parallelism is not None:
        loaded = load_job_spec(spec)
        job_spec = parse_job_spec(
            orjson.dumps({**orjson.loads(spec_to_json(loaded)), "parallelism": parallelism})
        )
    with _control(f"submitting {spec.name}...") as client:
        job = client.submit(job_spec, from_savepoint=from_savepoint, wait=wait)
    _show_status(job)


@app.command("list")
def list_jobs(state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None) -> None:
    """Every job control knows, oldest first."""
    with _control() as client:
        jobs = client.jobs(state)
    table = Table("job", "state", "processor", "submitted", "message")
    for j in jobs:
        table.add_row(
            escape(j["id"]),
            _state(j["state"]),
            escape(j["processor"]),
            _when(j["created_at_ms"]),
            escape(j["message"]),
        )
    console.print(table)


@app.command()
def status(job_id: str) -> None:
    """A job's state, why, where it runs, its savepoint."""
    with _control() as client:
        _show_status(client.status(job_id))


@app.command()
def cancel(job_id: str, wait: Annotated[bool, typer.Option(help="wait until it stopped")] = True) -> None:
    """Stop a job without a savepoint."""
    with _control(f"cancelling {job_id}...") as client:
        job = client.cancel(job_id, wait=wait)
    _show_status(job)


@app.command()
def savepoint(
    job_id: str,
    directory: Annotated[str, typer.Option("--dir", help="where (default: the processor's)")] = "",
    wait: Annotated[bool, typer.Option(help="wait for the savepoint")] = True,
) -> None:
    """Stop a job at a batch boundary with a savepoint (resume it with `resume`)."""
    with _control(f"taking a savepoint of {job_id}...") as client:
        job = client.savepoint(job_id, directory, wait=wait)
    _show_status(job)


@app.command()
def resume(
    job_id: str,
    savepoint_path: Annotated[str, typer.Option("--savepoint", help="default: the job's last")] = "",
    new_id: Annotated[str | None, typer.Option(help="run it under another id")] = None,
) -> None:
    """Start a stopped job again from a savepoint."""
    with _control(f"resuming {job_id}...") as client:
        job = client.resume(job_id, savepoint=savepoint_path, new_id=new_id)
    _show_status(job)


@app.command()
def results(
    job_id: str,
    key: Annotated[str | None, typer.Option(help="only this key")] = None,
    start: Annotated[int | None, typer.Option(help="windows starting at or after (epoch ms)")] = None,
    end: Annotated[int | None, typer.Option(help="windows starting before (epoch ms)")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 1000,
) -> None:
    """Window results from Redis, by key and time range."""
    with _control() as client:
        windows = client.results(job_id, key=key, start=start, end=end, limit=limit)
    names = sorted({n for w in windows for n in w["aggregates"]})
    table = Table("key", "window start (UTC)", "end", *names, "version", "final")
    for w in windows:
        table.add_row(
            escape(w["key"]),
            _when(w["window_start"]),
            _when(w["window_end"])[11:],
            *(str(w["aggregates"].get(n, "")) for n in names),
            str(w["version"]),
            "yes" if w["final"] else "",
        )
    console.print(table)
    console.print(f"[dim]{len(windows)} window(s)[/]")


@app.command()
def metrics(job_id: Annotated[str | None, typer.Argument(help="a job; without: the cluster")] = None) -> None:
    """A job's last metrics from its processor, or cluster-wide numbers."""
    with _control() as client:
        data = client.metrics(job_id) if job_id else client.cluster_metrics()
    values = data.get("metrics", data) if job_id else data
    table = Table("metric", "value")
    for name, value in values.items():
        table.add_row(name, escape(str(value)))
    console.print(table)


@app.command()
def services(service: Annotated[str | None, typer.Option(help="ingest, processor or sink")] = None) -> None:
    """Registered ingest, processor and sink instances: health, heartbeat, load."""
    with _control() as client:
        rows = client.services(service)
    table = Table(
        "instance", "service", "address", "health", "grpc health", "heartbeat", "cpu %", "rss MiB", "jobs"
    )
    for r in rows:
        health = "[green]alive[/]" if r["health"] == "alive" else "[red]lost[/]"
        table.add_row(
            escape(r["instance_id"]),
            r["service"],
            f"{r['host']}:{r['grpc_port']}",
            health,
            r["grpc_health"],
            f"{r['heartbeat_age_ms'] / 1000:.1f} s ago",
            f"{r['load'].get('cpu_percent', 0):.0f}",
            f"{r['load'].get('rss_bytes', 0) / 2**20:.0f}",
            escape(", ".join(r["jobs"])),
        )
    console.print(table)


@app.command()
def operators() -> None:
    """Installed operators a job's process section may name, and their parameters."""
    with _control() as client:
        rows = client.operators()
    table = Table("operator", "parameters", "time", "package", "what")
    for r in rows:
        schema = r["params_schema"]
        required = set(schema.get("required", []))
        params = [f"{n}{'' if n in required else '?'}" for n in schema.get("properties", {})]
        table.add_row(
            escape(r["name"]),
            escape(", ".join(params)),
            r["time_mode"],
            escape(r["distribution"]),
            escape(r["description"]),
        )
    console.print(table)


@app.command()
def producers(
    revoke: Annotated[str | None, typer.Option(help="revoke this minted producer first")] = None,
) -> None:
    """Kafka users minted for one stream each (POST /producers/{topic}) and what they may write."""
    with _control() as client:
        if revoke is not None:
            client.revoke_producer(revoke)
            console.print(f"revoked {escape(revoke)}")
        rows = client.producers()
    table = Table("producer", "may write")
    for r in rows:
        table.add_row(escape(r["username"]), escape(", ".join(r["topics"])))
    console.print(table)


# --- topics -------------------------------------------------------------------------------------------
@app.command()
def tail(
    topic: str,
    from_beginning: Annotated[bool, typer.Option(help="start at the oldest record")] = False,
    max_records: Annotated[int, typer.Option("--max", help="stop after this many (0: never)")] = 0,
    timeout_s: Annotated[float, typer.Option("--timeout", help="stop after this long idle (0: never)")] = 0,
) -> None:
    """Print a topic's records as they arrive (committed ones only), with key and headers."""
    consumer = Consumer(
        {
            **_kafka_config(),
            "group.id": f"streamforge-cli-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    seen = 0
    idle_since = time.monotonic()
    try:
        while not max_records or seen < max_records:
            m = consumer.poll(0.5)
            if m is None:
                if timeout_s and time.monotonic() - idle_since > timeout_s:
                    break
                continue
            problem = m.error()
            if problem is not None:
                if problem.code() != KafkaError._PARTITION_EOF:
                    err.print(f"[yellow]{escape(str(problem))}[/]")
                continue
            idle_since = time.monotonic()
            seen += 1
            key, value = _text(m.key()), _text(m.value())
            raw = m.headers() or []
            pairs = list(raw.items()) if isinstance(raw, dict) else list(raw)
            headers = " ".join(f"{k}={_text(v)}" for k, v in pairs)
            console.print(
                f"[dim]{m.partition()}@{m.offset()}[/] [cyan]{escape(key)}[/] {escape(value)}"
                + (f" [dim]{escape(headers)}[/]" if headers else "")
            )
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    err.print(f"[dim]{seen} record(s)[/]")


@app.command()
def produce(
    topic: str,
    events: Annotated[int, typer.Option(min=1, help="how many click events")] = 10_000,
    span: Annotated[str, typer.Option(help="event-time span they cover, ending now")] = "60s",
    bad_every: Annotated[int, typer.Option(help="a malformed record after every N (0: none)")] = 0,
    seed: Annotated[int, typer.Option(help="random seed (same seed, same data)")] = 7,
    mint: Annotated[
        bool, typer.Option(help="log in with a credential control mints for this topic, revoked after")
    ] = False,
) -> None:
    """Produce sample click events (pages, users, latencies, some out of order)."""
    from client.samples import click_events
    from shared.jobspec import parse_duration_ms

    try:
        span_ms = parse_duration_ms(span)
    except ValueError as e:
        raise _fail(e) from None
    now_ms = int(time.time() * 1000)
    data = click_events(events, start_ms=now_ms - span_ms, span_ms=span_ms, bad_every=bad_every, seed=seed)
    conf = _kafka_config()
    if not mint:
        _produce(Producer({**conf, "linger.ms": 5}), topic, data.records)
    else:
        with _control() as client:
            credential = client.mint_producer(topic)
            try:
                # Where Kafka is, as this machine reaches it; who we are, as control minted it.
                minted = producer_config(credential, **{"bootstrap.servers": conf["bootstrap.servers"]})
                _produce(Producer({**conf, **minted, "linger.ms": 5}), topic, data.records)
            finally:
                client.revoke_producer(credential["username"])
    console.print(
        f"produced {len(data.records)} records to {escape(topic)} "
        f"({len(data.good)} events, {len(data.bad)} malformed) over {span_ms // 1000} s of event time"
    )


def _produce(producer: Producer, topic: str, records: list[bytes]) -> None:
    failed: list[str] = []

    def delivered(error: Any, _msg: Any) -> None:
        if error is not None:
            failed.append(str(error))

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err) as progress:
        task = progress.add_task(f"producing to {topic}", total=len(records))
        for n, value in enumerate(records, 1):
            while True:
                try:
                    producer.produce(topic, value=value, on_delivery=delivered)
                    break
                except BufferError:  # local queue full: let it drain
                    producer.poll(0.1)
            producer.poll(0)
            if n % 500 == 0 or n == len(records):
                progress.update(task, completed=n)
        left = producer.flush(30)
    if left or failed:
        raise _fail(
            ClientError(0, f"{left} undelivered, {len(failed)} failed: {failed[:3]}", "produce", topic)
        )


if __name__ == "__main__":
    app()
