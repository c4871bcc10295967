"""The whole platform under faults, judged by an oracle computed from the input alone.

Three jobs (tumbling and sliding windows emitted on update, session windows emitted on close) read
three raw topics. A producer sends each its events, paced: in order within a bounded disorder, some
far behind (late), some bad in one of eleven ways, some sent twice. Meanwhile a fault thread SIGKILLs
ingest, the processor, the sink and control (each restarted at once), one processor kill right after
a savepoint request, and restarts the broker and Redis. At the end a final event per job, an hour
ahead, closes every session, and the run waits until Redis holds what the oracle says.

The oracle follows the documented rules, not the code: ingest dead-letters the bad records; a valid
record is late when its event time is below (the highest event time before it on its partition -
max_out_of_orderness - allowed_lateness); every other event counts in its windows exactly once. One
partition per topic and a Spark watermark delay equal to ingest's make that the whole truth: what
ingest forwards is never behind Spark's watermark.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
from confluent_kafka import Producer

from infra.local import procs
from infra.local.stack import (
    StackConfig,
    broker,
    redis_client,
    redis_server,
    start_service,
    wait_service_ready,
)
from shared.kafka import client_config, ensure_topics
from tests.bench.stack import Control
from tests.bench.workload import RedisWindows
from tests.kafka_util import read_all

BASE_MS = 1_767_225_600_000  # 2026-01-01: event time, unrelated to the wall clock
STEP_MS = 10  # event time advances 10 ms per event
DISORDER_MS = 1_500  # jitter within max_out_of_orderness (2 s)
OOO_MS, LATENESS_MS = 2_000, 1_000
KEYS = 50
LATE_SHARE, BAD_SHARE, DUPLICATE_SHARE = 0.01, 0.01, 0.005

JOBS: dict[str, dict[str, Any]] = {
    "tumbling": {
        "window": {"type": "tumbling", "size": "5s"},
        "aggregations": [{"fn": "count", "as": "n"}, {"fn": "sum", "field": "v", "as": "total"}],
    },
    "sliding": {
        "window": {"type": "sliding", "size": "10s", "slide": "5s"},
        "aggregations": [{"fn": "count", "as": "n"}, {"fn": "max", "field": "v", "as": "high"}],
    },
    "session": {
        "window": {"type": "session", "gap": "3s"},
        "emit": "on_window_close",
        "aggregations": [{"fn": "count", "as": "n"}, {"fn": "sum", "field": "v", "as": "total"}],
    },
}


def _bad_records(i: int, ts: int) -> list[bytes]:
    """Eleven kinds of input ingest must dead-letter (each refused for its own reason)."""
    good: dict[str, Any] = {"k": "k0", "v": 1, "ts": ts, "id": i}
    return [
        b"not json",
        b"[1, 2, 3]",  # not an object
        orjson.dumps({k: v for k, v in good.items() if k != "k"}),  # no key field
        orjson.dumps({k: v for k, v in good.items() if k != "ts"}),  # no event time
        orjson.dumps({**good, "ts": "yesterday"}),  # event time of the wrong type
        orjson.dumps({**good, "v": "seven"}),  # a long that is text
        b'{"k": "k0", "v": 18446744073709551616, "ts": %d, "id": %d}' % (ts, i),  # outside 64 bits
        b"",  # empty
        orjson.dumps({**good, "extra": 0}).replace(b'"extra":0', b'"extra":' + b"[" * 80 + b"]" * 80),
        orjson.dumps({**good, "v": True}),  # a boolean for a long
        orjson.dumps({**good, "ts": int(time.time() * 1000) + 10 * 86_400_000}),  # ten days ahead
    ]


BAD_KINDS = len(_bad_records(0, 0))


@dataclass
class JobInput:
    job_id: str
    kind: str
    records: list[bytes] = field(default_factory=list)  # in production order (one partition)
    bad: Counter[int] = field(default_factory=Counter)  # bad kind -> records sent
    bad_at: dict[int, int] = field(default_factory=dict)  # index in records -> its bad kind

    def truncate(self, sent: int) -> None:
        """Keep the first ``sent`` records: a load stopped early is judged on what it sent."""
        self.records = self.records[:sent]
        self.bad_at = {i: kind for i, kind in self.bad_at.items() if i < sent}
        self.bad = Counter(self.bad_at.values())


def make_input(job_id: str, kind: str, events: int, rng: random.Random) -> JobInput:
    data = JobInput(job_id, kind)
    for i in range(events):
        r = rng.random()
        ts = BASE_MS + i * STEP_MS + rng.randint(-DISORDER_MS, DISORDER_MS)
        if r < BAD_SHARE:
            which = i % BAD_KINDS
            data.bad_at[len(data.records)] = which
            data.records.append(_bad_records(i, ts)[which])
            data.bad[which] += 1
            continue
        if r < BAD_SHARE + LATE_SHARE:
            ts -= rng.randint(5_000, 60_000)  # far behind: late unless it is among the first events
        record = orjson.dumps(
            {"k": f"k{rng.randrange(KEYS)}", "v": rng.randint(-1_000, 1_000), "ts": ts, "id": i}
        )
        data.records.append(record)
        if r > 1 - DUPLICATE_SHARE:
            data.records.append(record)  # a producer's retry: the same event, twice in the topic
    return data


def closer(data: JobInput) -> bytes:
    """An event an hour past the last: Spark's watermark passes every real window, so sessions close."""
    return orjson.dumps(
        {"k": "closer", "v": 0, "ts": BASE_MS + 3_600_000 + len(data.records) * STEP_MS, "id": -1}
    )


@dataclass
class Expected:
    windows: dict[tuple[str, int], dict[str, float]]
    late_ids: Counter[int]
    dead_letters: int


def oracle(data: JobInput, spec: dict[str, Any]) -> Expected:
    high: int | None = None
    late: Counter[int] = Counter()
    valid: list[dict[str, Any]] = []
    for raw in data.records:
        try:
            e = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if not _valid(e):
            continue
        ts = int(e["ts"])
        if high is not None and ts < high - OOO_MS - LATENESS_MS:
            late[int(e["id"])] += 1
            continue
        high = ts if high is None else max(high, ts)
        valid.append(e)
    window = spec["window"]
    per: dict[tuple[str, int], list[int]] = {}
    if window["type"] == "session":
        # The closer event (an hour ahead) moves Spark's watermark past every real session: all close.
        for key, spans in _sessions(valid, 3_000).items():
            for start, values, _end in spans:
                per[(key, start)] = values
    else:
        size = 5_000 if window["type"] == "tumbling" else 10_000
        slide = size if window["type"] == "tumbling" else 5_000
        for e in valid:
            ts = int(e["ts"])
            first = ts - ts % slide - size + slide
            for start in range(first, ts + 1, slide):
                if start <= ts < start + size:
                    per.setdefault((str(e["k"]), start), []).append(int(e["v"]))
    names = [a.get("as") for a in spec["aggregations"]]
    windows = {}
    for w, values in per.items():
        agg: dict[str, float] = {"n": len(values)}
        if "total" in names:
            agg["total"] = sum(values)
        if "high" in names:
            agg["high"] = max(values)
        windows[w] = agg
    return Expected(windows, late, sum(data.bad.values()))


def _valid(e: Any) -> bool:
    """What the stream's validation accepts (the bad kinds above are the only invalid ones sent)."""
    return (
        isinstance(e, dict)
        and isinstance(e.get("k"), str)
        and type(e.get("ts")) is int
        and type(e.get("v")) is int
        and -(2**63) <= e["v"] < 2**63
        and "extra" not in e
        and e["ts"] < int(time.time() * 1000) + 86_400_000
    )


def _sessions(events: list[dict[str, Any]], gap: int) -> dict[str, list[tuple[int, list[int], int]]]:
    by_key: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        by_key.setdefault(str(e["k"]), []).append((int(e["ts"]), int(e["v"])))
    out: dict[str, list[tuple[int, list[int], int]]] = {}
    for key, points in by_key.items():
        points.sort()
        spans: list[tuple[int, list[int], int]] = []
        for ts, v in points:
            # Spark merges sessions that touch: an event exactly `gap` after the last one joins it.
            if spans and ts <= spans[-1][2]:
                start, values, end = spans[-1]
                spans[-1] = (start, [*values, v], max(end, ts + gap))
            else:
                spans.append((ts, [v], ts + gap))
        out[key] = spans
    return out


def spec_for(job_id: str, kind: str) -> dict[str, Any]:
    return {
        "id": job_id,
        "source": {
            "topic": job_id,
            "fields": {"k": "string", "v": "long", "ts": "timestamp", "id": "long"},
            "key": ["k"],
            "event_time": {"field": "ts"},
        },
        "watermark": {"max_out_of_orderness": f"{OOO_MS}ms", "allowed_lateness": f"{LATENESS_MS}ms"},
        "trigger_interval": "500ms",
        **JOBS[kind],
    }


@dataclass
class Fault:
    what: str
    at_s: float  # since the load started
    recovered_s: float | None = None  # until the component answered again
    error: str = ""
    # Further timings (seconds) and facts a fault reports, e.g. when results flowed again.
    measured: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    events_per_job: int
    rate: int  # events/s over all jobs
    kills_per_service: int
    savepoint_kill: bool
    restart_broker: bool
    restart_redis: bool
    seed: int = 11
    # None: the load is events_per_job per job at ``rate``, and the faults are spread over it. A number:
    # the load runs until the faults are done and this many seconds more (events_per_job is then a
    # ceiling), so every fault and its recovery happen under load however long they take.
    load_after_faults_s: float | None = None


class Faults(threading.Thread):
    """Injects the plan's faults one after another, spread over ``duration_s``."""

    def __init__(
        self,
        cfg: StackConfig,
        control: Control,
        plan: Plan,
        specs: dict[str, dict[str, Any]],
        duration_s: float,
    ) -> None:
        super().__init__(name="chaos-faults", daemon=True)
        self.cfg, self.control, self.specs = cfg, control, specs
        self.job_ids = list(specs)
        rng = random.Random(plan.seed)
        actions: list[str] = [
            s for s in ("ingest", "processor", "sink", "control") for _ in range(plan.kills_per_service)
        ]
        actions += ["savepoint+processor"] * plan.savepoint_kill + ["broker"] * plan.restart_broker
        actions += ["redis"] * plan.restart_redis
        rng.shuffle(actions)
        self.actions = actions
        self.gap_s = duration_s / (len(actions) + 1)
        self.done: list[Fault] = []
        self.started = time.monotonic()
        self.finished_at: float | None = None  # when the last fault was over

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.finished_at = time.monotonic()

    def _run(self) -> None:
        for action in self.actions:
            time.sleep(self.gap_s)
            fault = Fault(action, round(time.monotonic() - self.started, 1))
            began = time.monotonic()
            try:
                fault.measured = self._inject(action) or {}
                fault.recovered_s = round(time.monotonic() - began, 1)
            except Exception as e:  # recorded: the verdict fails on it
                fault.error = f"{type(e).__name__}: {e}"
            self.done.append(fault)

    def _inject(self, action: str) -> dict[str, Any] | None:
        cfg = self.cfg
        if action in ("broker", "redis"):
            server = broker(cfg) if action == "broker" else redis_server(cfg)
            server.stop()
            server.start()
            server.wait_ready(120)
            return None
        service = action.removeprefix("savepoint+")
        job = self.job_ids[0]
        if action.startswith("savepoint+"):
            self.control.http.post(f"/jobs/{job}/savepoint", params={"wait": "false"})
            time.sleep(0.3)  # the stop-with-savepoint is under way
        pid = procs.pid_of(service, cfg.run_dir)
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
            procs._wait_gone(pid, 15)
        start_service(cfg, service)
        wait_service_ready(cfg, service, timeout_s=240)
        if action.startswith("savepoint+"):
            self._carry_on(job)
        return None

    def _carry_on(self, job_id: str) -> None:
        """After a kill during a stop-with-savepoint, as a user would: resume from the savepoint if it
        was taken, else submit the job again (the processor resumes its checkpoint)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = self.control.status(job_id)
            state = status.get("state")
            if state == "RUNNING":
                return
            if state == "FINISHED" and status.get("savepoint_path"):
                self.control.http.post(f"/jobs/{job_id}/resume")
            elif state in ("CANCELED", "FAILED", "FINISHED"):
                self.control.http.post("/jobs", json=self.specs[job_id])
            time.sleep(1)
        raise RuntimeError(f"job {job_id} did not run again after the kill during its savepoint")


class MonotonicWatch(threading.Thread):
    """Reads one field of every window of the jobs in Redis every ``every_s``: a value that goes down
    is a regression (versions: the sink's compare-and-set let an older result overwrite a newer one;
    on-update counts: a result went back, a stale writer's or an older one written over a newer)."""

    def __init__(self, client: redis.Redis, job_ids: list[str], field: str, every_s: float = 1.0) -> None:
        super().__init__(name=f"chaos-{field}-watch", daemon=True)
        self.windows = [RedisWindows(client, j) for j in job_ids]
        self.field = field
        self.every_s = every_s
        self.seen: dict[tuple[str, str, int], int] = {}
        self.regressions: list[str] = []
        self.reads = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            for w in self.windows:
                try:
                    current = w.read([self.field])
                except redis.RedisError:
                    continue  # Redis is being restarted or failing over
                for (key, start), fields in current.items():
                    value = fields.get(self.field)
                    if value is None:
                        continue
                    before = self.seen.get((w.job_id, key, start))
                    if before is not None and int(value) < before:
                        self.regressions.append(f"{w.job_id} {key} {start}: {self.field} {before} -> {value}")
                    self.seen[(w.job_id, key, start)] = max(int(value), before or 0)
            self.reads += 1


def produce_paced(
    cfg: StackConfig,
    inputs: list[JobInput],
    rate: int,
    stop: Callable[[], bool],
    until: Callable[[], bool] | None = None,
) -> None:
    """Send every input's records at ``rate`` (or, once ``until()`` holds, stop early and truncate
    each input to what it sent), then a closer per input."""
    producer = Producer({**client_config(cfg.kafka), "enable.idempotence": True, "linger.ms": 5})
    order = [(d, r) for d in inputs for r in range(len(d.records))]
    order.sort(key=lambda p: p[1] / len(p[0].records))  # the three jobs advance together
    started = time.monotonic()
    sent = dict.fromkeys((d.job_id for d in inputs), 0)
    for n, (data, i) in enumerate(order):
        if n % 500 == 0:
            if until is not None and until():
                break
            ahead = n / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
            producer.poll(0)
        while True:
            try:
                producer.produce(data.job_id, value=data.records[i], partition=0)
                break
            except BufferError:
                producer.poll(0.1)
        sent[data.job_id] = i + 1  # each input's records go out in their order: a prefix was sent
    for data in inputs:
        data.truncate(sent[data.job_id])
    total = sum(len(d.records) for d in inputs)
    while producer.flush(30) > 0 and not stop():
        pass
    assert producer.flush(60) == 0, f"not every one of {total} records reached Kafka"
    for data in inputs:
        producer.produce(data.job_id, value=closer(data), partition=0)
    assert producer.flush(60) == 0


@dataclass
class JobVerdict:
    job_id: str
    kind: str
    windows_expected: int
    lost: int
    extra: int
    wrong: int
    dead_letters: tuple[int, int]  # (expected, found)
    late: tuple[int, int]  # (expected, found)
    late_ids_match: bool
    examples: list[str]

    @property
    def ok(self) -> bool:
        return (
            self.lost == self.extra == self.wrong == 0
            and self.dead_letters[0] == self.dead_letters[1]
            and self.late_ids_match
        )


def judge(
    cfg: StackConfig, data: JobInput, spec: dict[str, Any], client: redis.Redis, timeout_s: float
) -> JobVerdict:
    want = oracle(data, spec)
    names = [str(a["as"]) for a in spec["aggregations"]]
    windows = RedisWindows(client, data.job_id)
    deadline = time.monotonic() + timeout_s
    while True:
        got = {w: v for w, v in windows.read(names).items() if w[0] != "closer"}
        wrong = [
            w for w in want.windows if w in got and any(got[w].get(n) != want.windows[w][n] for n in names)
        ]
        lost = [w for w in want.windows if w not in got]
        extra = [w for w in got if w not in want.windows]
        if not (wrong or lost or extra) or time.monotonic() > deadline:
            break
        time.sleep(2)
    dlq = read_all(cfg.kafka, f"{data.job_id}.dlq", min_count=want.dead_letters, timeout_s=60)
    late_records = read_all(
        cfg.kafka, f"{data.job_id}.late", min_count=sum(want.late_ids.values()), timeout_s=60
    )
    late_found = Counter(int(orjson.loads(m.value())["id"]) for m in late_records)
    examples = [f"wrong {w}: {got[w]} != {want.windows[w]}" for w in wrong[:3]]
    examples += [f"lost {w}: {want.windows[w]}" for w in lost[:3]] + [
        f"extra {w}: {got[w]}" for w in extra[:3]
    ]
    return JobVerdict(
        data.job_id,
        data.kind,
        len(want.windows),
        len(lost),
        len(extra),
        len(wrong),
        (want.dead_letters, len(dlq)),
        (sum(want.late_ids.values()), len(late_records)),
        late_found == want.late_ids,
        examples,
    )


FaultsFactory = Callable[[StackConfig, Control, Plan, dict[str, dict[str, Any]], float], Faults]


def run(
    cfg: StackConfig,
    plan: Plan,
    log: Callable[[str], None] = print,
    settle_s: float = 300,
    faults_factory: FaultsFactory = Faults,
) -> dict[str, Any]:
    """One chaos run on the running stack ``cfg``: the report (``verdict`` says whether it passed).

    ``faults_factory`` makes the thread that injects the faults (tests/cluster has its own)."""
    rng = random.Random(plan.seed)
    run_id = uuid.uuid4().hex[:6]
    inputs = [make_input(f"chaos-{kind}-{run_id}", kind, plan.events_per_job, rng) for kind in JOBS]
    specs = {d.job_id: spec_for(d.job_id, d.kind) for d in inputs}
    with Control(cfg) as control:
        for data in inputs:
            ensure_topics(cfg.kafka, [data.job_id, f"{data.job_id}.valid"], partitions=1)
            control.submit(specs[data.job_id])
        ceiling = " at most" if plan.load_after_faults_s is not None else ""
        records = sum(len(d.records) for d in inputs)
        log(f"3 jobs running; sending{ceiling} {records:,} records at {plan.rate:,}/s")
        duration_s = sum(len(d.records) for d in inputs) / plan.rate
        faults = faults_factory(cfg, control, plan, specs, duration_s)
        started = time.monotonic()
        watch = MonotonicWatch(redis_client(cfg), list(specs), "version")
        watch.start()
        faults.start()
        tail_s = plan.load_after_faults_s

        def faults_over() -> bool:
            over = faults.finished_at
            return over is not None and tail_s is not None and time.monotonic() - over > tail_s

        produce_paced(
            cfg, inputs, plan.rate, stop=lambda: False, until=faults_over if tail_s is not None else None
        )
        load_s = time.monotonic() - started  # the last record (and the closers) acknowledged
        faults.join()
        log(
            f"load and {len(faults.done)} faults done in {time.monotonic() - started:.0f} s; "
            "waiting for the oracle"
        )
        client = redis_client(cfg)
        verdicts = [judge(cfg, d, specs[d.job_id], client, settle_s) for d in inputs]
        watch.stopped.set()
        watch.join(30)
    ok = all(v.ok for v in verdicts) and not any(f.error for f in faults.done) and not watch.regressions
    return {
        "verdict": "PASS" if ok else "FAIL",
        "events": sum(len(d.records) for d in inputs),
        "bad_records": {d.job_id: sum(d.bad.values()) for d in inputs},
        "faults": [f.__dict__ for f in faults.done],
        "jobs": [{**v.__dict__, "ok": v.ok} for v in verdicts],
        "version_reads": watch.reads,
        "version_regressions": watch.regressions[:20],
        "seconds": round(time.monotonic() - started, 1),
        "load_seconds": round(load_s, 1),
    }
