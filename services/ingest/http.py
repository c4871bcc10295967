"""HTTP ingest for producers that cannot speak Kafka: POST a JSON array of events, get 202.

It runs in the ingest process (uvicorn in a thread), sharing the stream definitions (control's too)
and the group's lag the backpressure reads. Each posted event is validated on the spot, so the
response says which were refused and why. Good events go to the stream's raw topic (keyed by its key
fields) and through the Kafka loop like any other; refused ones straight to the dead-letter topic
(partition and offset headers -1). The 202 is sent once the broker acknowledged every record (acks=all).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import orjson
import uvicorn
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.ingest.deadletters import fit, too_large
from services.ingest.errors import IngestError
from services.ingest.metrics import HTTP_EVENTS
from services.ingest.settings import HTTP_ACK_TIMEOUT_MS, MAX_MESSAGE_BYTES, IngestSettings
from services.ingest.streams import StreamDefinition
from services.ingest.tracing import RecordGate
from services.ingest.validate import (
    MAX_JSON_DEPTH,
    OVERSIZED_RECORD,
    RecordValidator,
    Rejection,
    ValidEvent,
)
from shared.jobspec import Source
from shared.kafka import check_metadata, dead_letter_headers
from shared.metrics import DLQ_EVENTS
from shared.tracing import current_traceparent, fastapi_telemetry, inject_headers, is_sampled_traceparent

log = logging.getLogger(__name__)
SERVICE = "ingest-http"
HDR_HTTP_INDEX = "sf.http.index"  # position of a dead letter in the request that posted it
TRACE_ROOM = 512  # bytes kept free in a posted event's record for the trace headers it may get


@dataclass
class _Delivery:
    """Delivery reports of one request's records; filled by whichever thread serves the producer."""

    producer: Producer  # the one this request's records went to, even if replaced since
    expected: int = 0  # records queued for this request
    errors: dict[int, str] = field(default_factory=dict)
    fatal: bool = False  # the producer hit a fatal error: it fails every record from now on
    reported: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def done(self) -> int:
        return len(self.reported)

    def report(self, index: int, err: KafkaError | None, _msg: Message | None) -> None:
        with self.lock:
            self.reported.add(index)
            if err is not None:
                self.errors[index] = str(err)
                self.fatal = self.fatal or err.fatal() or err.code() == KafkaError._FATAL


class StreamCatalog(Protocol):
    """What the HTTP endpoint needs of the ingest loop it runs beside (services.ingest.consumer.Ingest)."""

    tracer: trace.Tracer

    def stream(self, topic: str) -> StreamDefinition | None:
        """The stream of a raw topic as ingested now (control may change them at run time)."""

    def stream_definitions(self) -> list[StreamDefinition]: ...

    def validator_for(self, source: Source) -> RecordValidator:
        """A validator applying the ingest's record policy to ``source``'s events."""

    def event_clock_ms(self) -> int:
        """Now, on the clock the Kafka loop judges event times by."""

    def lag(self, topic: str) -> int | None:
        """Records of ``topic`` the ingest group has not committed yet (None: not known yet)."""

    def is_running(self) -> bool: ...

    def watermark_info(self, topic: str) -> dict[str, object]: ...


@dataclass(frozen=True)
class PostOutcome:
    status_code: int
    body: dict[str, Any]


class HttpIngest:
    """Validates posted events and publishes them; the FastAPI app is a thin layer over this."""

    def __init__(self, catalog: StreamCatalog, settings: IngestSettings) -> None:
        self.catalog = catalog
        s = settings
        self.settings = s
        self.queue_limit = 100_000
        self._gate = RecordGate(catalog.tracer)
        self._producer_lock = threading.Lock()
        self.producer = self._new_producer()

    def _new_producer(self) -> Producer:
        s = self.settings
        return Producer(
            {
                **s.kafka.config(),
                "enable.idempotence": True,  # broker retries never duplicate a posted event
                "acks": "all",
                "linger.ms": 5,
                "compression.type": "lz4",
                "queue.buffering.max.messages": self.queue_limit,
                "message.max.bytes": MAX_MESSAGE_BYTES,
            },
            logger=logging.getLogger("librdkafka.http"),
        )

    def stream(self, topic: str) -> StreamDefinition | None:
        return self.catalog.stream(topic)

    def overloaded(self, topic: str, count: int) -> str | None:
        """Why the pipeline cannot take ``count`` more events of ``topic`` now (None: it can)."""
        lag = self.catalog.lag(topic)
        limit = self.settings.tuning.http_max_lag_records
        if lag is not None and lag > limit:
            return f"ingest lags {lag} records behind on {topic} (limit {limit})"
        if len(self.producer) + count > self.queue_limit:
            return f"the producer queue holds {len(self.producer)} records not yet acknowledged"
        return None

    def publish(self, stream: StreamDefinition, docs: list[Any]) -> PostOutcome:
        """Check every event first, then write them: a request that cannot be written as a whole is
        refused before any of it is (a retry must not duplicate the first half)."""
        source = (self.catalog.stream(stream.topic) or stream).source
        validator, now = self.catalog.validator_for(source), self.catalog.event_clock_ms()
        checked: list[tuple[bytes, ValidEvent | Rejection]] = []
        unwritable: list[str] = []
        for i, doc in enumerate(docs):
            try:
                raw = orjson.dumps(doc)
            except orjson.JSONEncodeError as e:  # 255 levels deep: not even a dead letter can hold it
                unwritable.append(
                    f"event {i} is nested too deep to be written as JSON ({e}); "
                    f"events may nest {MAX_JSON_DEPTH} levels"
                )
                continue
            checked.append((raw, self._check(source, validator, raw, doc, now)))
        if unwritable:
            detail = "; ".join(unwritable[:5]) + (
                f"; and {len(unwritable) - 5} more" if len(unwritable) > 5 else ""
            )
            return PostOutcome(400, {"detail": f"{detail}: nothing of this request was written"})
        outcome, failed_producer = self._write(source, checked)
        if failed_producer is not None:
            self._replace_producer(failed_producer)
        return outcome

    def _replace_producer(self, failed: Producer) -> None:
        """An idempotent producer's fatal error (e.g. refused a producer id before its grants existed) is
        permanent for that client: the records it failed were answered as failed, the next get a new one.
        Requests that saw the same failure replace it once."""
        with self._producer_lock:
            if self.producer is not failed:
                return
            self.producer = self._new_producer()
        log.warning("the HTTP producer hit a fatal error; replaced it")
        # Serves the delivery reports still queued in it; a fatal producer raises its error instead.
        with contextlib.suppress(KafkaException):
            failed.flush(0)

    def _check(
        self, source: Source, validator: RecordValidator, raw: bytes, doc: Any, now: int
    ) -> ValidEvent | Rejection:
        """One posted event, as the Kafka loop would judge it, plus: does its raw-topic record fit?"""
        limit = validator.policy.max_record_bytes
        if len(raw) > limit:
            return Rejection(OVERSIZED_RECORD, f"record is {len(raw)} bytes, the limit is {limit}")
        verdict = validator.check_parsed(raw, doc, now)
        if isinstance(verdict, ValidEvent):
            # Room for the trace headers it may get when written.
            why = too_large(source.topic, verdict.key.encode(), raw, None, MAX_MESSAGE_BYTES - TRACE_ROOM)
            if why is not None:
                return Rejection(OVERSIZED_RECORD, why)
        return verdict

    def _write(
        self, source: Source, checked: list[tuple[bytes, ValidEvent | Rejection]]
    ) -> tuple[PostOutcome, Producer | None]:
        """The outcome, and the producer if it hit a fatal error on the way."""
        delivery = _Delivery(self.producer)
        results: list[dict[str, Any]] = []
        queue_full = False
        # A traced request (the client sent a sampled traceparent) hands its trace to every event it
        # carries; otherwise an event may start a trace at the sampling ratio, like a Kafka record.
        request_trace = current_traceparent()
        shared_trace = inject_headers() if request_trace and is_sampled_traceparent(request_trace) else None
        gate = self._gate
        for i, (raw, verdict) in enumerate(checked):
            report = functools.partial(delivery.report, i)
            if queue_full:
                results.append(
                    {"index": i, "status": "failed", "message": "not sent: the producer queue is full"}
                )
            elif isinstance(verdict, Rejection):
                key, value, headers = fit(
                    None,
                    raw,
                    dead_letter_headers(
                        source.topic,
                        -1,
                        -1,
                        verdict.error_class,
                        verdict.message,
                        SERVICE,
                        [(HDR_HTTP_INDEX, str(i).encode())],
                    ),
                    MAX_MESSAGE_BYTES,
                )
                queue_full = not self._produce(source.dlq_topic, key, value, headers, delivery, report)
                DLQ_EVENTS.labels(SERVICE, source.topic, verdict.error_class).inc()
                results.append(
                    {
                        "index": i,
                        "status": "rejected",
                        "error_class": verdict.error_class,
                        "message": verdict.message,
                    }
                )
            else:
                trace_headers = shared_trace
                if trace_headers is None and gate.choose():
                    trace_headers = self._trace_root(gate, source.topic)
                queue_full = not self._produce(
                    source.topic, verdict.key.encode(), raw, trace_headers, delivery, report
                )
                results.append({"index": i, "status": "accepted"})
        self._await(delivery)
        failed = 0
        with delivery.lock:
            reported, errors = set(delivery.reported), dict(delivery.errors)
        for i, r in enumerate(results):
            if i in errors or i not in reported:
                # Not acknowledged: the client must send it again (a timeout may still have written it).
                why = errors.get(i, f"not acknowledged within {HTTP_ACK_TIMEOUT_MS} ms")
                results[i] = {**r, "status": "failed", "message": why}
                failed += 1
        accepted = sum(1 for r in results if r["status"] == "accepted")
        rejected = sum(1 for r in results if r["status"] == "rejected")
        HTTP_EVENTS.labels(source.topic, "accepted").inc(accepted)
        HTTP_EVENTS.labels(source.topic, "rejected").inc(rejected)
        HTTP_EVENTS.labels(source.topic, "failed").inc(failed)
        body = {
            "topic": source.topic,
            "accepted": accepted,
            "rejected": rejected,
            "failed": failed,
            "results": results,
        }
        # A full queue is backpressure (429); a record the broker did not acknowledge is an outage (503).
        return PostOutcome(
            429 if queue_full else 503 if failed else 202, body
        ), delivery.producer if delivery.fatal else None

    def _produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, str | bytes | None]] | None,
        delivery: _Delivery,
        on_delivery: Any,
    ) -> bool:
        """Queue one record; False when the queue stayed full for the acknowledgement timeout."""
        deadline = time.monotonic() + HTTP_ACK_TIMEOUT_MS / 1000
        while True:
            try:
                delivery.producer.produce(
                    topic, key=key, value=value, headers=headers, on_delivery=on_delivery
                )
                delivery.expected += 1
                return True
            except KafkaException as e:  # refused at once (records are measured first: not expected)
                delivery.expected += 1
                on_delivery(e.args[0], None)
                return True
            except BufferError:
                if time.monotonic() > deadline:
                    return False
                delivery.producer.poll(0.05)

    def _trace_root(self, gate: RecordGate, topic: str) -> list[tuple[str, str | bytes | None]]:
        """Start a trace for one posted event: a short span whose context the record carries on."""
        parent = gate.context_for(None, chosen=True)
        span = self.catalog.tracer.start_span(f"post {topic}", context=parent, kind=SpanKind.SERVER)
        try:
            return inject_headers(None, trace.set_span_in_context(span))
        finally:
            span.end()

    def _await(self, delivery: _Delivery) -> None:
        deadline = time.monotonic() + HTTP_ACK_TIMEOUT_MS / 1000
        while delivery.done < delivery.expected and time.monotonic() < deadline:
            delivery.producer.poll(0.02)

    def close(self) -> None:
        self.producer.flush(10)


def get_gateway(request: Request) -> HttpIngest:
    gateway: HttpIngest = request.app.state.gateway
    return gateway


GatewayDep = Annotated[HttpIngest, Depends(get_gateway)]
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def require_token(request: Request) -> None:
    """Events and stream definitions only for holders of an SF_INGEST_HTTP_TOKENS token (constant-time
    comparison); health stays open."""
    settings = get_gateway(request).settings
    if settings.http_auth_disabled:
        return
    if not settings.http_tokens:
        raise HTTPException(
            401,
            "this ingest has no HTTP tokens configured, so it refuses every request: set "
            "SF_INGEST_HTTP_TOKENS='[\"<token>\"]' and send 'Authorization: Bearer <token>'",
            headers=_CHALLENGE,
        )
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise HTTPException(401, "send 'Authorization: Bearer <token>'", headers=_CHALLENGE)
    if not any(hmac.compare_digest(given.encode(), t.encode()) for t in settings.http_tokens):
        raise HTTPException(
            401, "the bearer token is not valid: use one of SF_INGEST_HTTP_TOKENS", headers=_CHALLENGE
        )


Authorized = [Depends(require_token)]


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)


def create_app(gateway: HttpIngest, tracer: trace.Tracer | None = None) -> FastAPI:
    """The ingest HTTP API; with a tracer from shared.tracing.setup_tracing, requests are traced."""
    extra: dict[str, Any] = {"telemetry": fastapi_telemetry(tracer)} if tracer is not None else {}
    app = FastAPI(title="StreamForge ingest", version="0.1.0", **extra)
    app.state.gateway = gateway
    settings = gateway.settings

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """Alive: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz(gw: GatewayDep) -> JSONResponse:
        """Ready: the Kafka loop runs and the broker answers a metadata request."""
        checks = {"loop": gw.catalog.is_running(), "kafka": check_metadata(settings.kafka)}
        ready = all(checks.values())
        return JSONResponse(status_code=200 if ready else 503, content={"ready": ready, "checks": checks})

    @app.get("/v1/streams", tags=["streams"], dependencies=Authorized)
    def list_streams(gw: GatewayDep) -> list[dict[str, Any]]:
        """The streams this ingest accepts events for."""
        return [d.model_dump(mode="json", by_alias=True) for d in gw.catalog.stream_definitions()]

    @app.get("/v1/streams/{topic}/watermark", tags=["streams"], dependencies=Authorized)
    def watermark(topic: str, gw: GatewayDep) -> JSONResponse:
        """The stream's current watermark and its lag behind processing time, per partition too."""
        if gw.stream(topic) is None:
            return _error(404, f"no stream is defined for topic {topic!r}")
        return JSONResponse(gw.catalog.watermark_info(topic))

    @app.post(
        "/v1/streams/{topic}/events",
        tags=["streams"],
        status_code=202,
        dependencies=Authorized,
        responses={
            401: {"description": "No valid bearer token"},
            400: {"description": "The body is not a JSON array"},
            404: {"description": "No stream is defined for this topic"},
            413: {"description": "The body exceeds the size limit"},
            429: {"description": "The pipeline lags: retry after Retry-After seconds"},
            503: {"description": "Some records were not acknowledged by Kafka: send those again"},
        },
    )
    async def post_events(topic: str, request: Request, gw: GatewayDep) -> JSONResponse:
        """Send a JSON array of events; 202 lists, per event, whether it was accepted or why not.

        Accepted events are in the stream's raw topic when the response is sent; refused ones are in
        its dead-letter topic with the reason in their headers.
        """
        stream = gw.stream(topic)
        if stream is None:
            return _error(404, f"no stream is defined for topic {topic!r}")
        limit = settings.http_max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return _error(400, "Content-Length is not a number")
            if int(declared) > limit:
                return _error(413, f"the body is {declared} bytes; the limit is {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return _error(413, f"the body exceeds the limit of {limit} bytes")
        try:
            docs = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            return _error(400, f"the body is not valid JSON: {e}")
        if not isinstance(docs, list):
            return _error(400, f"the body must be a JSON array of events, got {type(docs).__name__}")
        retry_after = {"Retry-After": str(settings.tuning.http_retry_after_s)}
        why = gw.overloaded(topic, len(docs))
        if why is not None:
            return _error(429, f"{why}; retry later", retry_after)
        outcome = await run_in_threadpool(gw.publish, stream, docs)
        headers = retry_after if outcome.status_code in (429, 503) else None
        return JSONResponse(status_code=outcome.status_code, content=outcome.body, headers=headers)

    return app


class HttpServer:
    """uvicorn in a daemon thread of the ingest process."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.address = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name="ingest-http", daemon=True)

    def start(self, timeout_s: float = 15.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise IngestError(f"the HTTP endpoint did not start on {self.address} (port in use?)")
            time.sleep(0.05)
        log.info("HTTP ingest on %s", self.address)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
