"""Recovery: SIGKILL the processor (its Python driver and its JVM) under load, restart it at once.

`python -m tests.bench recovery`. On the stack of tests/bench/stack.py, a count-only job (10 s
tumbling windows, default trigger) submitted through `POST /jobs`, 1,000 events/s on 1,000 keys plus
20 marker events/s (tests/bench/markers.py). After 45 s of warm-up (the broker's JIT, see
bench_freshness) and 20 s of steady load the processor running the job is killed with SIGKILL (its
process group) and started again right away, as a supervisor would; the load goes on throughout.
Variants:

- ``restart``: the stack's one processor; the restarted process resumes the job from its checkpoint
  by itself (its JVM and SparkSession start first);
- ``restart_tiered_jit``: as ``restart``, with the stack's processor started (before the job, and
  again after the kill) with tuning ``jit=tiered``: its JVM compiles with C1, then C2; the processor is
  started again as it was afterwards;
- ``standby``: a second processor runs beside it (infra.local.stack.start_standby_processor, started
  after the job was placed, warmed up by services/processor/warmup/ before registering); control
  learns of the dead processor from its closed connection and starts the job on the standby, from
  the same checkpoint. The restarted processor is the next standby;
- ``standby_again``: as ``standby``; then, once the restarted processor is up (it waited while its
  job ran on the standby, then started Spark: ProcessorTuning.taken_over_delay_s and
  taken_over_warmup_s), the standby, now running the job, is killed too. The figures are the second
  kill's (the first's under ``earlier_kills``): how fast the job moves back.

``SF_BENCH_RECOVERY_VARIANTS=standby`` runs one variant; ``SF_BENCH_RECOVERY_RESTART_DELAY_S=40``
starts the killed process 40 s later instead of at once (on 2 cores its JVM start competes with
the takeover). The figures: see ``figures``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from infra.local import procs
from infra.local.stack import (
    STANDBY_PROCESSOR,
    StackConfig,
    standby_metrics_url,
    start_service,
    start_standby_processor,
    wait_process_ready,
)
from services.processor.settings import ProcessorTuning
from services.processor.spark.session import JIT_OPTIONS
from shared.jobspec import JobSpec
from shared.kafka import ensure_topics
from tests.bench import workload
from tests.bench.markers import Load, Marker, MarkerWatch, first_timestamps, percentiles_ms
from tests.bench.stack import Control, job, restart_service, services_up

RATE = 1_000
MARKERS_PER_S = 20
WARMUP_S, BEFORE_S, STABLE_S, AFTER_MAX_S = 45, 20, 15, 150
# restart_tiered_jit before standby: with the standby up, control could place its job there.
VARIANTS = ("restart", "restart_tiered_jit", "standby", "standby_again")
STANDBY_VARIANTS = ("standby", "standby_again")
# standby_again: once the first kill's restart is up, the processor that took the job over is killed.
# An in-place restart is killed three times: the machine's load at the kill moves one sample by seconds.
KILLS = {"standby_again": 2, "restart": 3, "restart_tiered_jit": 3}
REPEATED = ("restart", "restart_tiered_jit")
# The stack processor's environment on top of the stack's, per variant.
PROCESSOR_ENV = {"restart_tiered_jit": {"SF_PROCESSOR_TUNING": json.dumps({"jit": "tiered"})}}
# Seconds before the killed process is started again (a supervisor's back-off); 0: at once, the
# default. On 2 cores a JVM start competes with the takeover; a delay shows what that costs.
RESTART_DELAY_S = float(os.environ.get("SF_BENCH_RECOVERY_RESTART_DELAY_S", "0"))
RUN_OF_FRESH = 20  # consecutive fresh markers that mean "fresh again"


def fresh_again(
    markers: list[Marker], watch: MarkerWatch, killed: float, threshold: float
) -> tuple[float | None, int]:
    """Receive time of the first of RUN_OF_FRESH consecutive fresh markers sent after the kill."""
    after = [m for m in markers if m.sent >= killed]
    run = 0
    for i, m in enumerate(after):
        f = watch.freshness(m)
        if f is None or f > threshold:
            run = 0
            continue
        run += 1
        if run == RUN_OF_FRESH:
            first = after[i - RUN_OF_FRESH + 1]
            return watch.seen[first.key], i - RUN_OF_FRESH + 1
    return None, len(after)


def main() -> dict[str, Any]:
    cfg = services_up()
    out: dict[str, Any] = {"rate": RATE, "marker_rate": MARKERS_PER_S, "variants": {}}
    try:
        for variant in os.environ.get("SF_BENCH_RECOVERY_VARIANTS", ",".join(VARIANTS)).split(","):
            env = PROCESSOR_ENV.get(variant)
            if env is None:
                out["variants"][variant] = measure(cfg, variant)
                continue
            restart_processor(cfg, env)
            try:
                out["variants"][variant] = measure(cfg, variant, env)
            finally:
                restart_processor(cfg, {})
    finally:
        procs.stop_process(STANDBY_PROCESSOR, cfg.run_dir, timeout_s=30)
    return out


def restart_processor(cfg: StackConfig, env: dict[str, str]) -> None:
    """Start the stack's processor again with ``env`` on top of the stack's environment."""
    restart_service(cfg, "processor", env, timeout_s=AFTER_MAX_S)


def jvm_options(pid: int) -> list[str]:
    """The -XX options of the JVMs among ``pid``'s children (the processor's Spark JVM)."""
    found: list[str] = []
    for child in procs.children_of(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        found += [a.decode() for a in argv if a.startswith(b"-XX:")]
    return found


def transition_s(control: Control, job_id: str, state: str, after: float) -> float | None:
    """Seconds from ``after`` until the job's history first shows ``state`` at or after it."""
    history = control.http.get(f"/jobs/{job_id}").json().get("history", [])
    times = [t["at_ms"] / 1000 for t in history if t["state"] == state and t["at_ms"] / 1000 >= after - 0.5]
    return round(min(times) - after, 1) if times else None


def running_process(cfg: StackConfig, control: Control, job_id: str) -> str:
    """The stack's process (its pid file's name) that runs the job, from control's registry."""
    instance = control.status(job_id).get("processor", "")
    rows = control.http.get("/services").json()["services"]
    port = next((r["grpc_port"] for r in rows if r["instance_id"] == instance), None)
    by_port = {cfg.grpc_ports[1]: "processor", cfg.standby_processor_ports[0]: STANDBY_PROCESSOR}
    if port not in by_port:
        raise RuntimeError(f"job {job_id} runs on {instance!r}, not a processor of this stack")
    return by_port[port]


@dataclass
class Kill:
    """One SIGKILL of the processor running the job, and what was known right after it."""

    victim: str
    killed: float  # time.time() of the kill
    threshold: float
    seen_before: list[float]
    ready: dict[str, float] = field(default_factory=dict)  # "at": when the restarted process answered
    spawned: float | None = None  # time.time() just before the restarted process was started
    load_at_kill: float = 0.0  # the machine's 1-minute load average at the kill (2 cores)
    # Read from the restarted process once it settled, before any later kill replaces it.
    phases: dict[str, float] = field(default_factory=dict)  # its start phases (start_phases)
    jvm_options: list[str] = field(default_factory=list)  # its JVM's -XX options


def kill_and_recover(
    cfg: StackConfig,
    control: Control,
    job_id: str,
    load: Load,
    watch: MarkerWatch,
    env: dict[str, str] | None,
) -> Kill:
    """BEFORE_S of load, SIGKILL of the job's processor, its restart (after RESTART_DELAY_S); the load
    goes on until fresh again and the restart is up (STABLE_S after each, at most AFTER_MAX_S)."""
    before = load.run(RATE, BEFORE_S, MARKERS_PER_S)
    victim = running_process(cfg, control, job_id)
    pid = procs.pid_of(victim, cfg.run_dir)
    if pid is None:
        raise RuntimeError(f"{victim} is not running")
    killed = time.time()
    os.killpg(pid, signal.SIGKILL)
    while procs.is_running(victim, cfg.run_dir):
        time.sleep(0.05)
    seen_before = [f for f in map(watch.freshness, before) if f is not None]
    kill = Kill(victim, killed, max(1.0, percentiles_ms(seen_before).get("p99_ms", 0) / 1000), seen_before)
    kill.load_at_kill = round(os.getloadavg()[0], 2)

    def wait_ready() -> None:  # restart the killed process (after RESTART_DELAY_S), wait for it
        time.sleep(RESTART_DELAY_S)
        kill.spawned = time.time()
        if victim == STANDBY_PROCESSOR:
            start_standby_processor(cfg, wait=False)
        else:
            start_service(cfg, "processor", env)
        wait_process_ready(cfg, victim, metrics_url(cfg, victim), AFTER_MAX_S)
        kill.ready["at"] = time.time()

    waiter = threading.Thread(target=wait_ready, daemon=True)
    waiter.start()
    checked = [0.0]

    def settled() -> bool:  # called by the load's loop: look twice a second
        if time.time() - checked[0] < 0.5:
            return False
        checked[0] = time.time()
        if time.time() - kill.ready.get("at", time.time()) < STABLE_S:
            return False  # the restart's start, whenever it comes, is measured too
        at, _ = fresh_again(load.markers, watch, killed, kill.threshold)
        return at is not None and time.time() - at >= STABLE_S

    load.run(RATE, AFTER_MAX_S, MARKERS_PER_S, until=settled)
    waiter.join(timeout=5)
    kill.phases = start_phases(metrics_url(cfg, victim))
    restarted = procs.pid_of(victim, cfg.run_dir)
    kill.jvm_options = jvm_options(restarted) if restarted is not None else []
    return kill


# The restarted processor's start phases (services/processor/start_clock.py), in their order.
START_PHASES = ("imports", "jvm", "session", "jobs_resumed", "first_batch_start", "first_batch")
START_PHASE_METRIC = "processor_start_phase_seconds"


def metrics_url(cfg: StackConfig, victim: str) -> str:
    """The /metrics page of the processor ``victim``."""
    if victim == STANDBY_PROCESSOR:
        return standby_metrics_url(cfg)
    return f"http://127.0.0.1:{cfg.metrics_ports[1]}/metrics"


def start_phases(url: str) -> dict[str, float]:
    """The start phases a processor's /metrics page reports: seconds after its process began."""
    try:
        text = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        if line.startswith(START_PHASE_METRIC + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('phase="', 1)[1].split('"', 1)[0]] = float(value)
    return found


def breakdown(
    cfg: StackConfig, kill: Kill, markers: list[Marker], watch: MarkerWatch, job_id: str, output_topic: str
) -> dict[str, float | None]:
    """Where the seconds from the kill until fresh again went, each step as seconds after the kill:
    the restarted process's start (``process_started``), its own start phases, control's RUNNING,
    the first window update of a marker sent after the kill in the output topic (``first_output``,
    its CreateTime) and in Redis (``first_in_redis``)."""
    out: dict[str, float | None] = {}
    if kill.spawned is None:
        return out
    spawned = kill.spawned - kill.killed
    out["process_started"] = round(spawned, 2)
    for phase in START_PHASES:
        out[phase] = round(spawned + kill.phases[phase], 2) if phase in kill.phases else None
    after = [m for m in markers if m.sent >= kill.killed]
    keys = {m.key for m in after}
    prefix = f"{job_id}|".encode()  # a window result's key: the job, then the window's key

    def marker_after_kill(key: bytes) -> str | None:
        found = key[len(prefix) :].decode() if key.startswith(prefix) else None
        return found if found in keys else None

    created = first_timestamps(cfg.kafka, output_topic, int(kill.killed * 1000), marker_after_kill)
    out["first_output"] = round(min(created.values()) - kill.killed, 2) if created else None
    seen = [watch.seen[m.key] for m in after if m.key in watch.seen]
    out["first_in_redis"] = round(min(seen) - kill.killed, 2) if seen else None
    return out


def jit_problems(jit: str, options: list[str]) -> list[str]:
    """Whether the restarted JVM compiles as its variant asked: with ``jit``'s option, or none."""
    if jit:
        return [] if jit in options else [f"the restarted JVM runs without {jit}"]
    quick_flag = JIT_OPTIONS["quick"].split("=", 1)[0]
    stopped = [o for o in options if o.startswith(quick_flag)]
    return [f"the restarted JVM runs with {stopped[0]}, not the tiered JIT"] if stopped else []


def figures(
    cfg: StackConfig,
    control: Control,
    job_id: str,
    kill: Kill,
    markers: list[Marker],
    watch: MarkerWatch,
    env: dict[str, str] | None,
    output_topic: str,
) -> dict[str, Any]:
    """A kill's figures from the markers sent until the next kill (``markers``):

    - threshold = max(1 s, p99 freshness of the markers of the 20 s before the kill);
    - **fresh again after** = from the kill until the first of 20 consecutive markers (one second of
      markers) sent after the kill, each within the threshold, appeared in Redis;
    - max freshness = the slowest marker sent from 10 s before the kill on;
    - processor ready after = from the kill until the restarted processor's /metrics answered;
    - lost / running again after = from the kill until control's job history shows FAILING / RUNNING;
    - max freshness after recovery = the slowest marker sent once fresh again.
    """
    killed = kill.killed
    recovered_at, stale = fresh_again(markers, watch, killed, kill.threshold)
    around = [m for m in markers if m.sent >= killed - 10]
    freshness = [(m.sent - killed, watch.freshness(m)) for m in around]
    since = recovered_at - killed if recovered_at is not None else float("inf")
    after = [f for t, f in freshness if f is not None and t >= since]
    options = kill.jvm_options
    tuning = json.loads((env or {}).get("SF_PROCESSOR_TUNING", "{}"))
    jit = JIT_OPTIONS[tuning.get("jit", ProcessorTuning.jit)]
    return {
        "killed": kill.victim,
        "threshold_s": round(kill.threshold, 2),
        "before_kill": percentiles_ms(kill.seen_before),
        "recovery_s": round(recovered_at - killed, 1) if recovered_at is not None else None,
        "stale_markers_after_kill": stale,
        "max_freshness_s": round(max((f for _, f in freshness if f is not None), default=0), 1),
        # the slowest marker sent once fresh again (the killed processor's restart comes in that time too)
        "max_freshness_after_recovery_s": round(max(after, default=0), 1),
        "never_seen_markers": sum(1 for _, f in freshness if f is None),
        "restart_delay_s": RESTART_DELAY_S,
        "load_at_kill": kill.load_at_kill,
        "restart_ready_s": round(kill.ready["at"] - killed, 1) if "at" in kill.ready else None,
        "lost_s": transition_s(control, job_id, "FAILING", killed),
        "running_again_s": transition_s(control, job_id, "RUNNING", killed),
        "jit_problems": jit_problems(jit, options),
        # the restarted processor's JVM options from its command line (the JIT's among them)
        "restarted_jvm_xx_options": options,
        # (seconds after the kill the marker was sent, its freshness in seconds) for the chart
        "markers": [(round(t, 2), round(f, 3)) for t, f in freshness if f is not None],
        # seconds after the kill each step of the recovery ended (see breakdown)
        "breakdown": breakdown(cfg, kill, markers, watch, job_id, output_topic),
    }


def median_kill(results: list[dict[str, Any]]) -> int:
    """Index of the kill with the median time to fresh again (one that never got fresh counts as slowest)."""
    slowest = float("inf")
    order = sorted(range(len(results)), key=lambda i: results[i]["recovery_s"] or slowest)
    return order[len(order) // 2]


def measure(cfg: StackConfig, variant: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The variant's kills (KILLS), one after the other; its figures are the last kill's (a REPEATED
    variant's: the median kill's, with every kill's time under ``recovery_samples_s``), with the
    other kills under ``earlier_kills``. Then every window in Redis must equal the count of events
    sent to it (nothing lost or counted twice by the crash)."""
    client = redis.Redis.from_url(cfg.redis_url)
    job_id = f"recovery-{variant.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    ensure_topics(cfg.kafka, [job_id], partitions=1)
    spec = workload.spec(job_id, workload.COUNT_ONLY)
    output = JobSpec.model_validate(spec).output_topic
    with Control(cfg) as control, job(control, spec):
        # The job runs on the stack's processor (the only one yet); the standby comes after it.
        if variant in STANDBY_VARIANTS and not procs.is_running(STANDBY_PROCESSOR, cfg.run_dir):
            start_standby_processor(cfg)  # warms up (a throwaway job of its own) before it registers
        load = Load(cfg.kafka, job_id)
        with MarkerWatch(cfg.redis_url, job_id) as watch:
            load.run(RATE, WARMUP_S, MARKERS_PER_S)
            kills = [
                kill_and_recover(cfg, control, job_id, load, watch, env) for _ in range(KILLS.get(variant, 1))
            ]
            outcome = load.wait_exact(client, job_id)
            # A kill's markers end where the next kill's begin (from 10 s before it: see figures).
            ends = [k.killed - 10 for k in kills[1:]] + [float("inf")]
            results = [
                figures(
                    cfg, control, job_id, k, [m for m in load.markers if m.sent < end], watch, env, output
                )
                for k, end in zip(kills, ends, strict=True)
            ]
        now_on = control.status(job_id).get("processor", "")
    if variant in STANDBY_VARIANTS:  # the job moved on: the killed process's restart is not its recovery
        for r in results:
            kept = ("first_output", "first_in_redis")
            r["breakdown"] = {k: v for k, v in r["breakdown"].items() if k in kept}
    problems = outcome.problems + [p for r in results for p in r.pop("jit_problems")]
    samples = {
        "recovery_samples_s": [r["recovery_s"] for r in results],
        "load_at_kill_samples": [r["load_at_kill"] for r in results],
    }
    main = results.pop(median_kill(results) if variant in REPEATED else len(results) - 1)
    if variant in REPEATED:
        main.update(samples)
    for r in results:
        r.pop("markers")
    return {
        "job": job_id,
        **main,
        "earlier_kills": results,
        "running_on": now_on,
        "exact": outcome.exact,
        "problems": problems,
        "events_sent": load.sent,
    }
