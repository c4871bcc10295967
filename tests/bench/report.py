"""The end-to-end report: one JSON, one PNG chart, Markdown tables, from the parts' results.

Reads .run/bench/<part>.json (the newest result of every part, each stamped with its commit, time
and load average) and writes report.json (every figure, plus the parts' full results), report.md
(the tables) and report.png (throughput, freshness, the burst's progress per stage, CPU per
process, recovery, memory). ``results_md`` renders the committed tests/bench/RESULTS.md: the run's
date and commit, each target met or missed, and the tables. A part that has not run or that failed
shows as such; nothing is made up.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from infra.paths import ROOT

Part = dict[str, Any]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out + ("+changes" if dirty else "")


def _load(out_dir: Path, names: tuple[str, ...]) -> dict[str, Part]:
    parts = {}
    for name in names:
        path = out_dir / f"{name}.json"
        if path.exists():
            parts[name] = json.loads(path.read_text())
    return parts


def _rate(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, int | float) else "-"


def _ms(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, int | float) and isinstance(b, int | float) and b:
        return a / b
    return None


def _x(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.2f}" if r < 10 else f"{r:.0f}"


def _checked(part: Part | None, exact: Any, what: str) -> str:
    if part is None:
        return "not run"
    if "error" in part:
        return f"failed: {part['error'][:120]}"
    if exact is True:
        return f"exact ({what})"
    return f"**NOT exact** ({what})"


def figures(parts: dict[str, Part]) -> dict[str, Any]:
    """The headline numbers, flat, each None when its part has not run or failed."""
    kafka, ingest, spark = parts.get("kafka", {}), parts.get("ingest", {}), parts.get("spark", {})
    pipeline, faust = parts.get("pipeline", {}), parts.get("faust", {})
    fresh, recovery, memory = parts.get("freshness", {}), parts.get("recovery", {}), parts.get("memory", {})
    f: dict[str, Any] = {
        "kafka_produce_events_per_s": kafka.get("produce_records_per_s"),
        "kafka_consume_events_per_s": kafka.get("consume_records_per_s"),
        "ingest_events_per_s": ingest.get("ingest_records_per_s"),
        "raw_consume_produce_transactional_events_per_s": ingest.get("raw_transactional_records_per_s"),
        "spark_count_events_per_s": spark.get("count", {}).get("events_per_s"),
        "spark_all_events_per_s": spark.get("all", {}).get("events_per_s"),
        "e2e_count_events_per_s": pipeline.get("count", {}).get("events_per_s"),
        "e2e_all_events_per_s": pipeline.get("all", {}).get("events_per_s"),
        "faust_count_events_per_s": faust.get("events_per_s"),
        "recovery_s": _variant(recovery, "restart").get("recovery_s"),
        "recovery_max_freshness_s": _variant(recovery, "restart").get("max_freshness_s"),
        "recovery_tiered_jit_s": _variant(recovery, "restart_tiered_jit").get("recovery_s"),
        "recovery_standby_s": _variant(recovery, "standby").get("recovery_s"),
        "recovery_standby_max_freshness_s": _variant(recovery, "standby").get("max_freshness_s"),
        "recovery_standby_again_s": _variant(recovery, "standby_again").get("recovery_s"),
        "memory_stack_total_mb": memory.get("stack_total_mb"),
    }
    f["e2e_count_over_faust"] = _ratio(f["e2e_count_events_per_s"], f["faust_count_events_per_s"])
    for mode, m in fresh.get("modes", {}).items():
        for rate, point in m.get("points", {}).items():
            for q in ("p50_ms", "p95_ms", "p99_ms", "max_ms"):
                f[f"freshness_{mode}_{rate}_{q}"] = point.get(q)
    return f


# --- Markdown -------------------------------------------------------------------------------------
def markdown(parts: dict[str, Part], commit: str) -> str:
    kafka, ingest, spark = parts.get("kafka"), parts.get("ingest"), parts.get("spark")
    pipeline, faust = parts.get("pipeline"), parts.get("faust")
    limit = (kafka or {}).get("produce_records_per_s")
    consume = (kafka or {}).get("consume_records_per_s")
    ing = (ingest or {}).get("ingest_records_per_s")
    raw_txn = (ingest or {}).get("raw_transactional_records_per_s")
    sp = spark or {}
    pl = pipeline or {}
    slowest_alone = min((v for v in (ing, sp.get("count", {}).get("events_per_s")) if v), default=None)
    lines = [
        "| stage | events/s | of the limit | ratio | checked |",
        "|---|---:|---:|---|---|",
    ]

    def row(stage: str, rate: Any, ratio: str, checked: str) -> None:
        lines.append(f"| {stage} | {_rate(rate)} | {_x(_ratio(rate, limit))} | {ratio} | {checked} |")

    k = kafka or {}
    row(
        f"raw confluent-kafka produce ({k.get('records', 0):,} x {k.get('record_bytes_avg', '?')} B, "
        f"{k.get('partitions', '?')} partitions): **the limit**",
        limit,
        "1",
        _checked(kafka, k.get("exact"), "every record consumed back, byte for byte"),
    )
    row("raw confluent-kafka consume", consume, "", _checked(kafka, k.get("exact"), "same records"))
    row(
        "ingest alone (validate, key, watermark, one transaction per batch; "
        f"{(ingest or {}).get('records', 0):,})",
        ing,
        f"{_x(_ratio(ing, raw_txn))} x raw consume→produce in transactions ({_rate(raw_txn)}/s)",
        _checked(ingest, (ingest or {}).get("exact"), "all forwarded to .valid"),
    )
    for label, what in (("count", "count only"), ("all", "all nine aggregates")):
        s = sp.get(label, {})
        steady = s.get("steady_events_per_s")
        row(
            f"Spark alone on `.valid`, {what} (1M, processor's plan)",
            s.get("events_per_s"),
            f"{_rate(steady)}/s after the first batch ({s.get('first_batch_s', '-')} s)",
            _checked(spark, s.get("exact"), f"{sp.get('windows', 0):,} windows on the output topic"),
        )
    for label, what in (("count", "count only"), ("all", "all nine aggregates")):
        p = pl.get(label, {})
        alone = (sp.get(label, {}) or {}).get("events_per_s")
        row(
            f"**end to end**, 1M burst, {what} (raw topic → Redis)",
            p.get("events_per_s"),
            f"{_x(_ratio(p.get('events_per_s'), alone))} x Spark alone"
            + (
                f", {_x(_ratio(p.get('events_per_s'), slowest_alone))} x slowest stage alone"
                if label == "count"
                else ""
            ),
            _checked(pipeline, p.get("exact"), f"{pl.get('windows', 0):,} windows in Redis"),
        )
    fa = faust or {}
    row(
        f"faust-streaming peer, count only ({fa.get('events', 0):,} events, raw topic → Redis)",
        fa.get("events_per_s"),
        f"StreamForge {_x(_ratio(pl.get('count', {}).get('events_per_s'), fa.get('events_per_s')))} x faust",
        _checked(faust, fa.get("exact"), f"{fa.get('windows', 0):,} windows in Redis"),
    )
    out = ["### Throughput", "", *lines, ""]
    out += (
        _freshness_md(parts.get("freshness"))
        + _recovery_md(parts.get("recovery"))
        + _memory_md(parts.get("memory"))
        + _silence_md(parts.get("silence"))
        + _hdfs_md(parts.get("hdfs"))
        + _hosts_md(parts.get("hosts"))
        + _auth_md(parts.get("auth"))
        + _operators_md(parts.get("operators"))
    )
    loads = [
        f"{name} {p['load_average_1m']['start']}-{p['load_average_1m']['end']}"
        for name, p in parts.items()
        if isinstance(p.get("load_average_1m"), dict)
    ]
    commits = sorted({p.get("commit", "?") for p in parts.values()})
    out += [
        f"`make bench` on {os.cpu_count()} cores, commit {', '.join(commits) or commit}; "
        f"1-minute load average per part (start-end): {'; '.join(loads) or 'no part has run'}. "
        "Every throughput figure: events ÷ seconds from the first event produced until the result "
        "equalled a plain-Python oracle.",
        "",
    ]
    return "\n".join(out)


def _not_run(head: list[str], part: Part | None) -> list[str]:
    """A section's head, then why it has no table: its part did not run, or failed."""
    return [*head, "not run" if part is None else f"failed: {part['error']}", ""]


def _freshness_md(part: Part | None) -> list[str]:
    out = ["### Freshness (marker event sent → its window's hash written in Redis)", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    out += [
        "| mode | events/s | p50 | p95 | p99 | max | ingest p50 / p99 | processor p50 / p99 | "
        "of it, commit p50 / p99 | sink p50 / p99 | of it, redis p50 / p99 | processor up (cores) | "
        "markers | checked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, m in part.get("modes", {}).items():
        label = mode.replace("_", "-")
        if not m.get("available"):
            out.append(f"| {label} | - | not available: {m.get('reason', '?')} | | | | | | | | | | | |")
            continue
        label += f" (trigger {m.get('trigger_interval_ms')} ms)"
        for rate, p in m.get("points", {}).items():
            checked = "exact" if m.get("exact") else "**NOT exact**"
            if p.get("lost"):
                checked += f", {p['lost']} markers never seen"
            stages = p.get("stages") or {}
            split = " | ".join(
                f"{_ms(stages.get(s, {}).get('p50_ms'))} / {_ms(stages.get(s, {}).get('p99_ms'))}"
                for s in ("ingest", "processor", "commit", "sink", "redis")
            )
            up, cores = p.get("processor_up_s"), (p.get("cores") or {}).get("processor", "?")
            age = f"{up / 60:.1f} min ({cores})" if up is not None else "?"
            out.append(
                f"| {label} | {int(rate):,} | {_ms(p.get('p50_ms'))} | {_ms(p.get('p95_ms'))} | "
                f"{_ms(p.get('p99_ms'))} | {_ms(p.get('max_ms'))} | {split} | {age} | "
                f"{p.get('markers', 0)} | {checked} |"
            )
    out += [
        "",
        "Stages, from the markers' Kafka CreateTimes: ingest = sent → produced to `.valid`; processor = "
        "→ its window's update produced to the output topic (with ingest's transaction commit); of it, "
        "commit = until that transaction's commit marker (from the broker's log); sink = "
        "→ written to Redis (with the output topic's delivery); of it, redis = from the sink's Redis call "
        "(the window's `updated_at_ms`) → the notification. Processor up: how long its process "
        "had run when the point's measurement began (the modes share one processor, in this order; its "
        "JVM compiles for minutes), with its cores during the measurement.",
    ]
    return [*out, *_boundaries_md(part), ""]


def _boundaries_md(part: Part) -> list[str]:
    """The real-time modes' batch boundaries, when the part read them from Spark's event log."""
    rows = [(mode, m["boundaries"]) for mode, m in part.get("modes", {}).items() if m.get("boundaries")]
    if not rows:
        return []
    steps = ("state_committed_ms", "batch_started_ms", "job_submitted_ms", "tasks_launched_ms")
    out = [
        "",
        "Real-time batch boundaries (Spark's event log, tests/bench/boundaries.py), p50 / max of each step "
        "from the source's last read of a batch: its state committed (job end) → the next batch started → "
        "its job submitted → its tasks launched:",
        "",
        "| mode | boundaries | not reading | state committed | batch started | job submitted "
        "| tasks launched | records waiting (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, b in rows:
        cells = " | ".join(
            f"{_ms(b.get(k, {}).get('p50_ms'))} / {_ms(b.get(k, {}).get('max_ms'))}"
            for k in ("not_reading_ms", *steps)
        )
        out.append(
            f"| {mode.replace('_', '-')} | {b.get('boundaries', 0)} | {cells} "
            f"| {b.get('waiting_records_max')} |"
        )
    return out


VARIANT_LABELS = {
    "restart": "restarted in place (the stack's one processor)",
    "restart_tiered_jit": "restarted in place, tiered JIT (tuning `jit=tiered`: C1 then C2)",
    "standby": "a second processor takes over (control: connection closed)",
    "standby_again": "the second kill: then the processor that took over, once the first one's restart is up",
}


def _variant(part: Part, name: str) -> Part:
    """One variant of the recovery part (a run from before the variants: the restart)."""
    variants = part.get("variants")
    if isinstance(variants, dict):
        found = variants.get(name, {})
        return found if isinstance(found, dict) else {}
    return part if name == "restart" and "recovery_s" in part else {}


def _recovery_md(part: Part | None) -> list[str]:
    out = ["### Recovery after SIGKILL of the processor (driver and JVM), restarted at once", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    out += [
        f"Load: {part.get('rate', 0):,} events/s + {part.get('marker_rate', 0)} markers/s.",
        "",
        "| recovery | fresh again after | max freshness | fresh means | job lost / running again | "
        "killed process ready after | checked |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for name, label in VARIANT_LABELS.items():
        v = _variant(part, name)
        if not v:
            continue
        samples = v.get("recovery_samples_s") or []
        each = f" ({', '.join(f'{x} s' for x in samples)})" if len(samples) > 1 else ""
        out.append(
            f"| {label} | {v.get('recovery_s', '-')} s{each} | {v.get('max_freshness_s', '-')} s "
            f"({v.get('max_freshness_after_recovery_s', '-')} s after) | "
            f"≤ {v.get('threshold_s', '-')} s (max of 1 s and the p99 before the kill) | "
            f"{v.get('lost_s', '-')} s / {v.get('running_again_s', '-')} s | "
            f"{v.get('restart_ready_s', '-')} s | {'exact' if v.get('exact') else '**NOT exact**'} |"
        )
    out += [
        "",
        "Fresh again = from the kill until the first of 20 consecutive markers (one second) within the "
        "threshold appeared in Redis (a restart in place: the median of three kills, each in brackets, "
        "and the other columns from that kill); max freshness from 10 s before the kill on (after: of "
        "the markers sent once fresh again, while the killed processor's restart comes up). Job lost / "
        "running again: control's job history (FAILING, RUNNING).",
        "",
    ]
    return out + _recovery_breakdown_md(part)


# The recovery bench's breakdown (bench_recovery.breakdown): its steps, in order, with their headings.
IN_PLACE_VARIANTS = ("restart", "restart_tiered_jit")
BREAKDOWN_STEPS = {
    "imports": "Python up",
    "jvm": "JVM up",
    "session": "session up",
    "jobs_resumed": "job resumed",
    "first_batch_start": "1st batch starts",
    "first_batch": "1st batch done",
    "first_output": "1st output",
    "first_in_redis": "1st in Redis",
}


def _recovery_breakdown_md(part: Part) -> list[str]:
    """Where each restarted variant's seconds went: each step's end, in seconds after the kill."""
    rows = []
    for name, label in VARIANT_LABELS.items():
        steps = _variant(part, name).get("breakdown")
        if name not in IN_PLACE_VARIANTS:
            continue
        if not isinstance(steps, dict) or not steps:
            continue
        cells = " | ".join(f"{steps[k]}" if steps.get(k) is not None else "-" for k in BREAKDOWN_STEPS)
        v = _variant(part, name)
        rows.append(f"| {label} | {cells} | {v.get('recovery_s', '-')} | {v.get('load_at_kill', '-')} |")
    if not rows:
        return []
    return [
        "Where the seconds went (seconds after the kill at which each step ended):",
        "",
        f"| recovery | {' | '.join(BREAKDOWN_STEPS.values())} | fresh again | load at the kill |",
        f"|---|{'---:|' * (len(BREAKDOWN_STEPS) + 2)}",
        *rows,
        "",
        "Python up: the restarted process's interpreter and imports; JVM and session: Spark's; job resumed: "
        "its plan built and query started from the checkpoint; 1st batch: the restarted query's first "
        "micro-batch with rows (it replays the batch the kill interrupted, and restores the RocksDB state); "
        "1st output / in Redis: the first window update of a marker sent after the kill, in the job's "
        "output topic (its CreateTime) and in Redis.",
        "",
    ]


def _memory_md(part: Part | None) -> list[str]:
    out = [f"### Resident memory with {(part or {}).get('windows', 100_000):,} active windows (MiB)", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    rss = part.get("rss_mb", {})
    names = [n for n in ("ingest", "processor", "sink", "control", "kafka", "redis") if n in rss]
    state = part.get("state_rows")
    checked = "exact" if part.get("exact") else "**NOT exact**"
    if isinstance(state, int):
        checked += f", {state:,} rows in the processor's state"
    out += [
        "| " + " | ".join(names) + " | stack total | (zipkin) | checked |",
        "|" + "---:|" * (len(names) + 2) + "---|",
        "| " + " | ".join(f"{rss[n]:,.0f}" for n in names) + f" | **{part.get('stack_total_mb', 0):,.0f}** | "
        f"{rss.get('zipkin', 0):,.0f} | {checked} |",
        "",
        "Processor = its Python driver and its JVM; services are fresh processes; Zipkin (tracing UI) is "
        "not counted in the total.",
        "",
    ]
    return out


def _silence_md(part: Part | None) -> list[str]:
    out = ["### A silent stream's last windows (window end → its final result in Redis)", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    checked = "exact" if part.get("exact") else "**NOT exact**"
    return [
        *out,
        "| idle timeout | out-of-orderness | worst after the end | after the end + out-of-orderness "
        "| after the stream's end | checked |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {part.get('idle_timeout_ms')} ms | {part.get('max_out_of_orderness_ms')} ms "
        f"| {part.get('worst_after_end_s')} s | {part.get('worst_after_end_plus_ooo_s')} s "
        f"| {part.get('worst_after_stream_end_s')} s | {checked}, {part.get('windows')} windows |",
        "",
    ]


def _operators_md(part: Part | None) -> list[str]:
    out = ["### A custom operator against the declarative job with the same results", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    rows = [
        "| job | events/s (backlog) | after its first batch | batches | checked |",
        "|---|---:|---:|---:|---|",
    ]
    labels = {
        "operator": "`running_total` operator (transformWithState, Python)",
        "declarative": "declarative: sum and count in one window per key",
    }
    for label, name in labels.items():
        rate, steady = part.get(f"{label}_events_per_s"), part.get(f"{label}_steady_events_per_s")
        checked = "exact" if part.get(f"{label}_exact") else "**NOT exact**"
        rows.append(
            f"| {name} | {_rate(rate)} | {_rate(steady)} | {part.get(f'{label}_data_batches')} | {checked} |"
        )
    return [
        *out,
        f"{part.get('events', 0):,} events on {part.get('keys')} keys already in `.valid`, each job from "
        "its first batch to its last in one SparkSession configured as the processor's.",
        "",
        *rows,
        "",
        f"The operator job runs at {part.get('operator_vs_declarative')} x the declarative job's events/s.",
        "",
    ]


def _hdfs_md(part: Part | None) -> list[str]:
    out = ["### Checkpoints on HDFS against local disk (a windowed count's micro-batches, medians)", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    rows = [
        "| checkpoint | rows/s | batch | offset log | commit log | state commit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for where, m in part.get("medians", {}).items():
        rows.append(
            f"| {where} | {m['rows_per_s']:,.0f} | {m['triggerExecution_ms']:.0f} ms "
            f"| {m['walCommit_ms']:.0f} ms | {m['commitOffsets_ms']:.0f} ms | {m['state_commit_ms']:.0f} ms |"
        )
    share = part.get("hdfs_throughput_share")
    return [
        *out,
        *rows,
        "",
        f"HDFS keeps {share:.0%} of local disk's throughput (target: at least 90 %).",
        "",
    ]


def _hosts_md(part: Part | None) -> list[str]:
    out = ["### A host lost, a standby on another (tests/hosts topology, under load)", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    fresh = ", ".join(f"{job} {s} s" for job, s in (part.get("fresh_again_s") or {}).items())
    checked = "exact" if part.get("exact") else "**NOT exact**"
    return [
        *out,
        "| host lost | jobs running on the standby | results fresh again (per job) | target | checked |",
        "|---|---:|---|---:|---|",
        f"| {part.get('host')} | {part.get('failover_s')} s | {fresh} | 10 s | {checked} |",
        "",
    ]


def _auth_md(part: Part | None) -> list[str]:
    out = ["### Kafka authentication (SASL/SCRAM and ACLs) on and off", ""]
    if part is None or "error" in part:
        return _not_run(out, part)
    rows = [
        "| Kafka | burst events/s (best; each) | freshness p50 / p99 (micro-batch, per rate) | checked |",
        "|---|---:|---|---|",
    ]
    for label, key in (("authenticated", "authenticated"), ("open to anyone", "open")):
        m = part.get(key, {})
        burst = m.get("burst", {})
        points = (m.get("freshness") or {}).get("points", {})
        fresh = "; ".join(
            f"{int(rate):,}/s: {_ms(p.get('p50_ms'))} / {_ms(p.get('p99_ms'))}" for rate, p in points.items()
        )
        checked = (
            "exact" if burst.get("exact") and (m.get("freshness") or {}).get("exact") else "**NOT exact**"
        )
        samples = ", ".join(_rate(r) for r in burst.get("samples", []))
        rate = _rate(burst.get("events_per_s")) + (f" ({samples})" if samples else "")
        rows.append(f"| {label} | {rate} | {fresh or '-'} | {checked} |")
    ratio = part.get("burst_ratio")
    verdict = f"{ratio:.0%} of the open broker's best burst (target: at least 90 %)" if ratio else "no ratio"
    return [*out, *rows, "", f"Authenticated: {verdict}.", ""]


# --- the chart ------------------------------------------------------------------------------------
def chart(parts: dict[str, Part], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(20, 10.5))
    _chart_throughput(axes[0][0], parts)
    _chart_freshness(axes[0][1], parts.get("freshness"))
    _chart_burst(axes[0][2], parts.get("pipeline"))
    _chart_cores(axes[1][0], parts.get("pipeline"))
    _chart_recovery(axes[1][1], parts.get("recovery"))
    _chart_memory(axes[1][2], parts.get("memory"))
    fig.suptitle(f"StreamForge make bench ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _empty(ax: Any, title: str, why: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, transform=ax.transAxes)
    ax.set_axis_off()


def _chart_throughput(ax: Any, parts: dict[str, Part]) -> None:
    f = figures(parts)
    rows = [
        ("raw produce", f["kafka_produce_events_per_s"], parts.get("kafka", {}).get("exact")),
        ("raw consume", f["kafka_consume_events_per_s"], parts.get("kafka", {}).get("exact")),
        ("ingest alone", f["ingest_events_per_s"], parts.get("ingest", {}).get("exact")),
        (
            "Spark alone, count",
            f["spark_count_events_per_s"],
            parts.get("spark", {}).get("count", {}).get("exact"),
        ),
        (
            "Spark alone, all nine",
            f["spark_all_events_per_s"],
            parts.get("spark", {}).get("all", {}).get("exact"),
        ),
        (
            "end to end, count",
            f["e2e_count_events_per_s"],
            parts.get("pipeline", {}).get("count", {}).get("exact"),
        ),
        (
            "end to end, all nine",
            f["e2e_all_events_per_s"],
            parts.get("pipeline", {}).get("all", {}).get("exact"),
        ),
        ("faust peer, count", f["faust_count_events_per_s"], parts.get("faust", {}).get("exact")),
    ]
    rows = [r for r in rows if isinstance(r[1], int | float)]
    if not rows:
        return _empty(ax, "Throughput", "no throughput part has run")
    labels = [r[0] for r in rows][::-1]
    values = [r[1] for r in rows][::-1]
    colors = ["tab:green" if r[2] else "tab:red" for r in rows][::-1]
    ax.barh(labels, values, color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("events/s (log; green: exact against the oracle)")
    ax.set_title("Throughput")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)


def _chart_freshness(ax: Any, part: Part | None) -> None:
    if not part or "error" in part:
        return _empty(ax, "Freshness", "not run" if not part else part["error"])
    groups = []
    notes = []
    for mode, m in part.get("modes", {}).items():
        if not m.get("available"):
            notes.append(f"{mode}: not available")
            continue
        for rate, p in m.get("points", {}).items():
            groups.append((f"{mode.replace('_', '-')}\n{int(rate):,}/s", p))
    if not groups:
        return _empty(ax, "Freshness", "\n".join(notes) or "no point measured")
    qs = ("p50_ms", "p95_ms", "p99_ms", "max_ms")
    width = 0.2
    for j, q in enumerate(qs):
        xs = [i + (j - 1.5) * width for i in range(len(groups))]
        ax.bar(xs, [p.get(q) or 0 for _, p in groups], width, label=q.removesuffix("_ms"))
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title("Freshness: marker sent → its window in Redis")
    ax.legend(fontsize=8)
    if notes:
        ax.text(0.01, 0.98, "\n".join(notes), transform=ax.transAxes, va="top", fontsize=8)


def _chart_burst(ax: Any, part: Part | None) -> None:
    if not part or "error" in part:
        return _empty(ax, "1M burst: progress per stage", "not run" if not part else part["error"])
    styles = {"count": "-", "all": "--"}
    for label, run in ((k, part.get(k, {})) for k in ("count", "all")):
        stages = run.get("progress", {})
        for stage, color in (("ingest", "tab:blue"), ("processor", "tab:orange"), ("redis", "tab:green")):
            points = stages.get(stage) or []
            if points:
                ax.plot(
                    [t for t, _ in points],
                    [n for _, n in points],
                    styles[label],
                    color=color,
                    label=f"{stage} ({label})",
                )
    ax.set_xlabel("seconds since the first event was produced")
    ax.set_ylabel("events done")
    ax.set_title("1M burst: events through each stage")
    if ax.lines:
        ax.legend(fontsize=8)


def _chart_cores(ax: Any, part: Part | None) -> None:
    if not part or "error" in part:
        return _empty(ax, "CPU during the burst", "not run" if not part else part["error"])
    names = ["ingest", "processor", "sink", "control", "kafka", "redis", "zipkin", "machine"]
    width = 0.4
    for j, label in enumerate(("count", "all")):
        cores = part.get(label, {}).get("cores", {})
        ax.bar([i + (j - 0.5) * width for i in range(len(names))], [cores.get(n, 0) for n in names], width,
               label=label)  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.axhline(os.cpu_count() or 2, color="grey", linestyle=":", linewidth=1)
    ax.set_ylabel("cores used on average (process + children; machine: all processes)")
    ax.set_title("CPU per process during the 1M burst")
    ax.legend(fontsize=8)


def _chart_recovery(ax: Any, part: Part | None) -> None:
    if not part or "error" in part:
        return _empty(ax, "Recovery after SIGKILL", "not run" if not part else part["error"])
    shown = [(name, _variant(part, name)) for name in VARIANT_LABELS]
    shown = [(name, v) for name, v in shown if v.get("markers")]
    if not shown:
        return _empty(ax, "Recovery after SIGKILL", "no markers")
    ax.axvline(0, color="red", linewidth=1, label="SIGKILL + restart")
    for (name, v), color in zip(shown, ("tab:blue", "tab:green", "tab:orange", "tab:purple"), strict=False):
        markers = v["markers"]
        ax.scatter([m[0] for m in markers], [m[1] for m in markers], s=4, color=color, label=name)
        if isinstance(v.get("recovery_s"), int | float):
            ax.axvline(
                v["recovery_s"],
                color=color,
                linewidth=1,
                linestyle="--",
                label=f"{name}: fresh again ({v['recovery_s']} s)",
            )
    ax.axhline(shown[0][1].get("threshold_s", 1), color="grey", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("marker sent, seconds after the kill")
    ax.set_ylabel("freshness, s (log)")
    ax.set_title(f"Recovery under {part.get('rate', 0):,} events/s")
    ax.legend(fontsize=8)


def _chart_memory(ax: Any, part: Part | None) -> None:
    if not part or "error" in part:
        return _empty(ax, "Resident memory", "not run" if not part else part["error"])
    rss = part.get("rss_mb", {})
    names = [n for n in ("ingest", "processor", "sink", "control", "kafka", "redis", "zipkin") if n in rss]
    ax.bar(names, [rss[n] for n in names])
    for i, n in enumerate(names):
        ax.text(i, rss[n], f"{rss[n]:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("MiB resident")
    ax.set_title(
        f"Memory, {part.get('windows', 0):,} active windows (stack {part.get('stack_total_mb', 0):,.0f} MiB)"
    )


# --- RESULTS.md: the committed results file ---------------------------------------------------------
TWO_GIB_MB = 2048
# One figure against its target: label, the figure as read (None: not measured), exact against the
# oracle, whether it meets the target.
Check = tuple[str, str | None, Any, bool]


def _num(*values: Any) -> bool:
    return all(isinstance(v, int | float) for v in values)


def _within(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    return isinstance(value, int | float) and low <= value <= high


def _target(goal: str, part: Part | None, name: str, checks: list[Check]) -> str:
    """One line: the goal, then met or missed per check, with the figure that decides it."""
    if part is None:
        return f"- {goal}: not measured (`{name}` has not run)"
    if "error" in part:
        return f"- {goal}: not measured (`{name}` failed)"
    said = []
    for label, figure, exact, met in checks:
        if figure is None:
            said.append(f"{label}not measured")
        elif exact is not True:
            said.append(f"{label}not counted: not exact against the oracle ({figure})")
        else:
            said.append(f"{label}{'met' if met else '**missed**'} ({figure})")
    return f"- {goal}: " + ("; ".join(said) or "not measured")


def target_lines(parts: dict[str, Part]) -> list[str]:
    """Each target of the platform, met or missed in these results (or why it is not known)."""
    pipeline, fresh = parts.get("pipeline"), parts.get("freshness")
    recovery, memory = parts.get("recovery"), parts.get("memory")
    burst: list[Check] = []
    for key, label, floor in (("count", "count only", 100_000), ("all", "all nine", 60_000)):
        run = (pipeline or {}).get(key, {})
        rate = run.get("events_per_s")
        burst.append(
            (
                f"{label} ",
                f"{_rate(rate)}/s" if _num(rate) else None,
                run.get("exact"),
                _within(rate, low=floor),
            )
        )
    modes = (fresh or {}).get("modes", {})
    realtime: list[Check] = []
    micro_1s: list[Check] = []
    micro: list[Check] = []
    for mode, m in modes.items():
        point = m.get("points", {}).get("10000", {})
        p50, p99 = point.get("p50_ms"), point.get("p99_ms")
        figure = f"p50 {_ms(p50)}, p99 {_ms(p99)}" if _num(p50, p99) else None
        if mode.startswith("real_time"):
            if figure is not None and _num(p99):
                figure += f", {_ms(p99 - 100)} above the design's p99 < 100 ms" if p99 >= 100 else ""
            realtime.append(
                (
                    f"{mode.replace('_', '-')} (trigger {m.get('trigger_interval_ms', '?')} ms) ",
                    figure,
                    m.get("exact"),
                    _within(p50, high=50) and _within(p99, high=250),
                )
            )
        elif mode == "micro_batch_1s":
            micro_1s.append(("", figure, m.get("exact"), _within(p99, high=1000)))
        elif mode == "micro_batch":
            micro.append(
                (
                    f"trigger {m.get('trigger_interval_ms', '?')} ms ",
                    figure,
                    m.get("exact"),
                    _within(p99, high=1500),
                )
            )
    restarts: list[Check] = []
    for name in VARIANT_LABELS:
        v = _variant(recovery or {}, name)
        s = v.get("recovery_s")
        if v:
            restarts.append((f"{name} ", f"{s} s" if _num(s) else None, v.get("exact"), _within(s, high=10)))
    total = (memory or {}).get("stack_total_mb")
    silence = parts.get("silence")
    late = (silence or {}).get("worst_after_end_plus_ooo_s")
    return [
        _target(
            "end to end, 1M burst: ≥ 100,000 events/s count only, ≥ 60,000 all nine aggregates",
            pipeline,
            "pipeline",
            burst,
        ),
        _target(
            "real-time freshness at 10,000 events/s: p50 ≤ 50 ms and p99 ≤ 250 ms",
            fresh,
            "freshness",
            realtime,
        ),
        _target(
            "micro-batch freshness with a 1 s trigger at 10,000 events/s: p99 ≤ 1 s",
            fresh,
            "freshness",
            micro_1s,
        ),
        _target(
            "micro-batch freshness with its default trigger at 10,000 events/s: p99 ≤ 1.5 s",
            fresh,
            "freshness",
            micro,
        ),
        _target(
            "recovery after a processor SIGKILL: fresh again within 10 s", recovery, "recovery", restarts
        ),
        _target(
            "a silent stream's last window final within 5 s after its end plus the out-of-orderness",
            silence,
            "silence",
            [
                (
                    "",
                    f"{late} s after the end plus the out-of-orderness" if _num(late) else None,
                    (silence or {}).get("exact"),
                    _within(late, high=5),
                )
            ],
        ),
        _target(
            f"resident memory with 100,000 active windows: ≤ 2 GiB ({TWO_GIB_MB:,} MiB)",
            memory,
            "memory",
            [
                (
                    "",
                    f"{total:,.0f} MiB" if _num(total) else None,
                    (memory or {}).get("exact"),
                    _within(total, high=TWO_GIB_MB),
                )
            ],
        ),
    ]


def results_md(parts: dict[str, Part], names: tuple[str, ...], commit: str, tables: str) -> str:
    """tests/bench/RESULTS.md: the run's date (UTC) and commit, the targets, each part's stamp, the tables."""
    ran = [p for p in parts.values() if "measured_at" in p]
    dates = sorted(p["measured_at"] for p in ran)
    when = f"{dates[0]} to {dates[-1]}" if dates else "no part has run"
    commits = sorted({p.get("commit", "?") for p in ran}) or [commit]
    out = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`python -m tests.bench`; `python -m tests.bench report` rewrites it from",
        "the parts' last results in .run/bench). Do not edit by hand. What each part measures and how:",
        "[README.md](README.md).",
        "",
        f"- run: {when}",
        f"- commit: {', '.join(commits)}",
        f"- written: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC on {os.cpu_count()} cores",
        "",
        "## Targets",
        "",
        *target_lines(parts),
        "",
        "## Parts",
        "",
        "| part | result | commit | measured at | 1-minute load average (start-end) |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        p = parts.get(name)
        if p is None:
            out.append(f"| {name} | not run | | | |")
            continue
        load = p.get("load_average_1m") or {}
        result = f"failed: {str(p['error'])[:120]}" if "error" in p else "ran"
        out.append(
            f"| {name} | {result} | {p.get('commit', '?')} | {p.get('measured_at', '?')} "
            f"| {load.get('start', '?')}-{load.get('end', '?')} |"
        )
    return "\n".join([*out, "", tables.replace("### ", "## ")])


def write_report(out_dir: Path, names: tuple[str, ...], results: Path | None = None) -> str:
    """Write report.json, report.md and report.png (and ``results``, when given); returns the Markdown."""
    parts = _load(out_dir, names)
    commit = git_commit()
    md = markdown(parts, commit)
    report = {
        "generated_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit,
        "cores": os.cpu_count(),
        "figures": figures(parts),
        "parts": parts,
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "report.md").write_text(md)
    if results is not None:
        results.write_text(results_md(parts, names, commit, md))
    chart(parts, out_dir / "report.png")
    return md
