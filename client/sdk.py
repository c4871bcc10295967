"""The Python SDK: a fluent job builder that compiles to the declarative spec, and an API client.

    job = Job("views").source("clicks", fields={"page": "string", "ts": "timestamp"}, key="page",
                              event_time="ts").window(tumbling("10s")).aggregate(count())
    with Client("http://127.0.0.1:8081", token="...") as client:
        client.submit(job)

``build()`` returns a validated ``JobSpec`` (SpecError says what to fix). Expressions are Spark SQL
strings the processor checks with Spark's parser; no Python function is ever shipped to the cluster.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import httpx
import orjson
import yaml

from shared import constants
from shared.errors import SpecError, StreamForgeError
from shared.jobspec import JobSpec, parse_job_spec, spec_to_json

Duration = str | int  # "10s", "500ms", "1m", or milliseconds
JobInfo = dict[str, Any]  # the control API's JSON (see /docs)


# --- windows and aggregations -----------------------------------------------------------------------
def tumbling(size: Duration) -> dict[str, Any]:
    """Fixed, non-overlapping windows of ``size``."""
    return {"type": "tumbling", "size": size}


def sliding(size: Duration, slide: Duration) -> dict[str, Any]:
    """Windows of ``size`` starting every ``slide`` (an event is in size/slide windows)."""
    return {"type": "sliding", "size": size, "slide": slide}


def session(gap: Duration) -> dict[str, Any]:
    """Per-key sessions that close after ``gap`` without events (needs emit on_window_close)."""
    return {"type": "session", "gap": gap}


def _agg(fn: str, field: str | None, as_: str | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"fn": fn, **extra}
    if field is not None:
        out["field"] = field
    if as_ is not None:
        out["as"] = as_
    return out


def count(field: str | None = None, as_: str | None = None) -> dict[str, Any]:
    """Events in the window (or non-null values of ``field``); named ``count`` unless ``as_``."""
    return _agg("count", field, as_)


def sum_(field: str, as_: str | None = None) -> dict[str, Any]:
    return _agg("sum", field, as_)


def avg(field: str, as_: str | None = None) -> dict[str, Any]:
    return _agg("avg", field, as_)


def min_(field: str, as_: str | None = None) -> dict[str, Any]:
    return _agg("min", field, as_)


def max_(field: str, as_: str | None = None) -> dict[str, Any]:
    return _agg("max", field, as_)


def stddev(field: str, as_: str | None = None, *, population: bool = False) -> dict[str, Any]:
    """Sample standard deviation (n - 1), or the population one with ``population=True``."""
    return _agg("stddev_pop" if population else "stddev", field, as_)


def percentiles(
    field: str, qs: list[float], as_: str | None = None, *, accuracy: int | None = None
) -> dict[str, Any]:
    """Approximate percentiles, e.g. ``percentiles("latency_ms", [50, 95, 99])`` -> latency_ms_p95..."""
    extra: dict[str, Any] = {"percentiles": list(qs)}
    if accuracy is not None:
        extra["accuracy"] = accuracy
    return _agg("percentiles", field, as_, **extra)


# --- the builder ------------------------------------------------------------------------------------
class Job:
    """A fluent builder: each call returns a new builder, so a partial one can be reused."""

    def __init__(self, job_id: str, *, name: str | None = None, _spec: dict[str, Any] | None = None) -> None:
        self._spec: dict[str, Any] = dict(_spec) if _spec is not None else {"id": job_id}
        if name is not None:
            self._spec["name"] = name

    def _with(self, **changes: Any) -> Job:
        return Job(self._spec["id"], _spec={**self._spec, **changes})

    @property
    def id(self) -> str:
        return str(self._spec["id"])

    def source(
        self,
        topic: str,
        *,
        fields: Mapping[str, str],
        key: list[str] | str,
        event_time: str,
        time_format: Literal["epoch_ms", "iso8601"] = "epoch_ms",
    ) -> Job:
        """The raw topic producers write JSON events to, their fields (name -> type), key and event time."""
        return self._with(source=_source(topic, fields, key, event_time, time_format))

    def map(self, name: str, expression: str) -> Job:
        """A computed field: ``map("total", "price * qty")`` (a Spark SQL expression)."""
        derive = {**self._spec.get("derive", {}), name: expression}
        return self._with(derive=derive)

    def flat_map(self, name: str, generator: str) -> Job:
        """One row per element: ``flat_map("word", "explode(split(line, ' '))")``."""
        return self.map(name, generator)

    def filter(self, condition: str) -> Job:
        """Keep events for which the Spark SQL condition holds (several filters are ANDed)."""
        current = self._spec.get("filter")
        return self._with(filter=f"({current}) AND ({condition})" if current else condition)

    def dedup(self, *fields: str) -> Job:
        """Forward the first event of each id (``fields``) seen within the watermark."""
        return self._with(dedup={"fields": list(fields)})

    def join(
        self,
        topic: str,
        *,
        fields: Mapping[str, str],
        key: list[str] | str,
        event_time: str,
        within: Duration,
        prefix: str = "right_",
        time_format: Literal["epoch_ms", "iso8601"] = "epoch_ms",
    ) -> Job:
        """Time-bounded inner join with a second stream on the key fields."""
        joined = {"source": _source(topic, fields, key, event_time, time_format), "within": within}
        return self._with(join={**joined, "prefix": prefix})

    def key_by(self, *fields: str) -> Job:
        """What keys the windows (default: the source's key fields)."""
        return self._with(group_by=list(fields))

    def window(self, window: dict[str, Any]) -> Job:
        """``tumbling("10s")``, ``sliding("30s", "10s")`` or ``session("5s")``."""
        return self._with(window=dict(window))

    def watermark(
        self,
        max_out_of_orderness: Duration,
        allowed_lateness: Duration = 0,
        idle_timeout: Duration | None = None,
    ) -> Job:
        """``idle_timeout``: how long every partition of the stream stays silent before event time
        follows processing time (None: the out-of-orderness bound; 0: never)."""
        watermark: dict[str, Any] = {
            "max_out_of_orderness": max_out_of_orderness,
            "allowed_lateness": allowed_lateness,
        }
        if idle_timeout is not None:
            watermark["idle_timeout"] = idle_timeout
        return self._with(watermark=watermark)

    def aggregate(self, *aggregations: dict[str, Any]) -> Job:
        return self._with(aggregations=[*self._spec.get("aggregations", []), *aggregations])

    def reduce(self, field: str, expr: str, zero: str = "0", as_: str | None = None) -> Job:
        """Fold each window's values of ``field`` with a Spark SQL expression of ``a`` and ``b``."""
        section = {"field": field, "expr": expr, "zero": zero, **({"as": as_} if as_ else {})}
        return self._with(reduce=section)

    def process(self, operator: str, **params: Any) -> Job:
        """Run an installed operator per key (``streamforge operators`` lists them) with ``params``."""
        return self._with(process={"operator": operator, "params": params})

    def having(self, condition: str) -> Job:
        """Emit only windows whose aggregates satisfy the Spark SQL condition."""
        return self._with(having=condition)

    def emit(self, policy: Literal["on_update", "on_window_close"]) -> Job:
        return self._with(emit=policy)

    def trigger(self, interval: Duration, mode: Literal["micro_batch", "real_time"] = "micro_batch") -> Job:
        return self._with(trigger_interval=interval, trigger_mode=mode)

    def set_parallelism(self, slots: int) -> Job:
        """The task slots the job reserves on its processor (micro-batch: also its state partitions'
        upper bound); control refuses the job (429) when no processor has them free."""
        return self._with(parallelism=slots)

    parallelism = set_parallelism

    def to(self, output_topic: str) -> Job:
        return self._with(output_topic=output_topic)

    def to_dict(self) -> dict[str, Any]:
        """The spec as written so far (not validated)."""
        return dict(self._spec)

    def build(self) -> JobSpec:
        """The validated spec; SpecError says what to fix."""
        return parse_job_spec(orjson.dumps(self._spec))

    def to_yaml(self) -> str:
        return yaml.safe_dump(orjson.loads(spec_to_json(self.build())), sort_keys=False)


def _source(
    topic: str, fields: Mapping[str, str], key: list[str] | str, event_time: str, time_format: str
) -> dict[str, Any]:
    return {
        "topic": topic,
        "fields": dict(fields),
        "key": [key] if isinstance(key, str) else list(key),
        "event_time": {"field": event_time, "format": time_format},
    }


# --- the client -------------------------------------------------------------------------------------
class ClientError(StreamForgeError):
    """The control API refused a request; ``detail`` is its message (what to fix)."""

    def __init__(self, status_code: int, detail: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: {status_code} {detail}")
        self.status_code = status_code
        self.detail = detail


class Client:
    """The control API over HTTP: submit, jobs, status, cancel, savepoint, resume, results...

    ``url`` names one control replica or several (a list, or a comma-separated string): requests go to
    one, and move to the next when it cannot be reached or answers as a standby (503 with the
    ``SF-Control-Leader`` header), the named leader first. ``http`` may be any httpx.Client (e.g.
    FastAPI's TestClient); by default one is made per URL.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8081",
        token: str | None = None,
        *,
        timeout_s: float = 60.0,
        http: httpx.Client | None = None,
    ) -> None:
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owned = http is None
        self._timeout_s = timeout_s
        self.urls = [u.strip().rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        self.urls = [part for u in self.urls for part in (p.strip() for p in u.split(",")) if part]
        if not self.urls:
            raise ValueError("Client needs at least one control URL")
        self._current = 0
        self._clients: dict[str, httpx.Client] = {}
        if http is not None:
            http.headers.update(self._headers)
            self._clients = {self.urls[0]: http}
            self.urls = self.urls[:1]

    @property
    def url(self) -> str:
        """The control replica requests go to now."""
        return self.urls[self._current]

    @property
    def http(self) -> httpx.Client:
        client = self._clients.get(self.url)
        if client is None:
            client = httpx.Client(base_url=self.url, timeout=self._timeout_s, headers=self._headers)
            self._clients[self.url] = client
        return client

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        for attempt in range(len(self.urls)):
            last = attempt == len(self.urls) - 1
            try:
                resp = self.http.request(method, path, **kwargs)
            except httpx.ConnectError as e:  # never sent: safe to send to another replica
                if last:
                    raise ClientError(0, f"control is unreachable: {e}", method, path) from e
                self._current = (self._current + 1) % len(self.urls)
                continue
            except httpx.HTTPError as e:
                raise ClientError(0, f"control is unreachable: {e}", method, path) from e
            if resp.status_code == 503 and constants.CONTROL_LEADER_HEADER in resp.headers and not last:
                leader = resp.headers[constants.CONTROL_LEADER_HEADER].rstrip("/")
                following = leader in self.urls and leader != self.url
                self._current = self.urls.index(leader) if following else (self._current + 1) % len(self.urls)
                continue
            if resp.status_code >= 400:
                try:
                    detail = resp.json().get("detail", resp.text)
                except ValueError:
                    detail = resp.text
                raise ClientError(resp.status_code, str(detail), method, path)
            return resp.json() if resp.content else None
        raise AssertionError("unreachable")  # the last attempt returns or raises

    # --- jobs -------------------------------------------------------------------------------------------
    def submit(
        self, job: Job | JobSpec | str | Path, *, from_savepoint: str = "", wait: bool = True
    ) -> JobInfo:
        """Submit a builder, a spec, a spec file (.yaml/.yml/.json) or spec text (JSON or YAML)."""
        body, media = _spec_body(job)
        params: dict[str, Any] = {"wait": wait}
        if from_savepoint:
            params["from_savepoint"] = from_savepoint
        return dict(self._call("POST", "/jobs", content=body, headers={"Content-Type": media}, params=params))

    def jobs(self, state: str | None = None) -> list[JobInfo]:
        """Every job control knows (or those in ``state``), oldest first."""
        params = {"state": state} if state else {}
        return list(self._call("GET", "/jobs", params=params)["jobs"])

    def get(self, job_id: str) -> JobInfo:
        return dict(self._call("GET", f"/jobs/{job_id}"))

    def status(self, job_id: str) -> JobInfo:
        return dict(self._call("GET", f"/jobs/{job_id}/status"))

    def metrics(self, job_id: str) -> JobInfo:
        return dict(self._call("GET", f"/jobs/{job_id}/metrics"))

    def cancel(self, job_id: str, *, wait: bool = True) -> JobInfo:
        return dict(self._call("POST", f"/jobs/{job_id}/cancel", params={"wait": wait}))

    def savepoint(self, job_id: str, directory: str = "", *, wait: bool = True) -> JobInfo:
        """Stop the job with a savepoint; ``savepoint_path`` is set once it is FINISHED."""
        params: dict[str, Any] = {"wait": wait}
        if directory:
            params["directory"] = directory
        return dict(self._call("POST", f"/jobs/{job_id}/savepoint", params=params))

    def resume(
        self, job_id: str, *, savepoint: str = "", new_id: str | None = None, wait: bool = True
    ) -> JobInfo:
        """Start a final job's spec again from a savepoint (default: its last), maybe under new_id."""
        params: dict[str, Any] = {"wait": wait}
        if savepoint:
            params["savepoint"] = savepoint
        if new_id:
            params["new_id"] = new_id
        return dict(self._call("POST", f"/jobs/{job_id}/resume", params=params))

    def results(
        self,
        job_id: str,
        *,
        key: str | None = None,
        start: int | None = None,
        end: int | None = None,
        limit: int = 1000,
    ) -> list[JobInfo]:
        """Window results: every key, or one; windows starting in [start, end) (epoch ms)."""
        params: dict[str, Any] = {"limit": limit}
        params.update({k: v for k, v in (("key", key), ("start", start), ("end", end)) if v is not None})
        return list(self._call("GET", f"/jobs/{job_id}/results", params=params)["results"])

    def wait_for(self, job_id: str, *states: str, timeout_s: float = 120.0, poll_s: float = 0.5) -> JobInfo:
        """Poll the job's status until it is in one of ``states``; TimeoutError with the last status."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.status(job_id)
            if current["state"] in states:
                return current
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is {current['state']} ({current['message']}), not {states}")
            time.sleep(poll_s)

    # --- cluster ----------------------------------------------------------------------------------------
    def services(self, service: str | None = None) -> list[JobInfo]:
        params = {"service": service} if service else {}
        return list(self._call("GET", "/services", params=params)["services"])

    def cluster_metrics(self) -> JobInfo:
        return dict(self._call("GET", "/cluster/metrics"))

    def mint_producer(self, topic: str) -> JobInfo:
        """A new Kafka credential that may write ``topic`` (a job's raw topic) and nothing else; its
        password is in the answer only. ``producer_config`` turns it into a client config."""
        return dict(self._call("POST", f"/producers/{topic}"))

    def producers(self) -> list[JobInfo]:
        """The producers minted and not yet revoked, each with the topics it may write."""
        return list(self._call("GET", "/producers"))

    def revoke_producer(self, username: str) -> None:
        self._call("DELETE", f"/producers/{username}")

    def operators(self) -> list[JobInfo]:
        """The installed operators a job may name, with their parameters' JSON schemas."""
        return list(self._call("GET", "/operators")["operators"])


def producer_config(credential: JobInfo, **extra: Any) -> dict[str, Any]:
    """librdkafka properties for a credential from ``Client.mint_producer``, then ``extra``."""
    return {
        "bootstrap.servers": credential["bootstrap_servers"],
        "security.protocol": credential["security_protocol"].lower(),
        "sasl.mechanism": credential["sasl_mechanism"],
        "sasl.username": credential["username"],
        "sasl.password": credential["password"],
        # Over SASL_SSL the credential brings the CA to trust, so no file has to travel with it.
        **({"ssl.ca.pem": credential["ssl_ca_pem"]} if credential.get("ssl_ca_pem") else {}),
        **extra,
    }


def _spec_body(job: Job | JobSpec | str | Path) -> tuple[bytes, str]:
    if isinstance(job, Job):
        return spec_to_json(job.build()).encode(), "application/json"
    if isinstance(job, JobSpec):
        return spec_to_json(job).encode(), "application/json"
    if isinstance(job, Path) or (isinstance(job, str) and "\n" not in job and Path(job).suffix in _SUFFIXES):
        path = Path(job)
        try:
            text = path.read_text()
        except OSError as e:
            raise SpecError(f"cannot read job spec {path}: {e.strerror}") from e
        return text.encode(), "application/json" if path.suffix == ".json" else "application/yaml"
    text = job.strip()
    return text.encode(), "application/json" if text.startswith("{") else "application/yaml"


_SUFFIXES = (".yaml", ".yml", ".json")
