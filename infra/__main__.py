"""CLI: python -m infra {fetch,up,down,status,smoke,pki,cluster} [--run-dir DIR] [ports...]."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra import pki
from infra.artifacts import apt, class_archive, fetch, local_fs
from infra.errors import InfraError
from infra.local import procs, redis_sentinel
from infra.local.kafka_broker import DEFAULT_HEAP, KafkaBroker
from infra.local.redis_server import RedisServer
from infra.paths import CACHE_DIR, RUN_DIR

if TYPE_CHECKING:
    from infra.cluster.topology import ClusterConfig

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _step(msg: str) -> None:
    console.print(f"[cyan]•[/] {escape(msg)}")


def _done(msg: str, t0: float) -> None:
    console.print(f"[green]✓[/] {escape(msg)} [dim]({time.monotonic() - t0:.1f} s)[/]")


def cmd_fetch(args: argparse.Namespace) -> None:
    for name, resolve in fetch.BUNDLES:
        t0 = time.monotonic()
        _step(f"{name} jars")
        res = resolve(args.cache_dir, log=_step)
        versions = ", ".join(f"{k}={v}" for k, v in res.versions.items())
        how = "resolved with maven" if res.fetched else "cached, maven not run"
        _done(f"{name}: {len(res.jars)} jars ({versions}; {how})", t0)
    t0 = time.monotonic()
    jars = fetch.spark_kafka_jars(args.cache_dir, log=_step)
    _done(f"spark.jars after removing what pyspark ships: {', '.join(j.name for j in jars)}", t0)


def _services(args: argparse.Namespace) -> tuple[KafkaBroker, RedisServer]:
    kafka = KafkaBroker(
        args.run_dir, args.kafka_port, args.controller_port, args.kafka_heap, cache_dir=args.cache_dir
    )
    return kafka, RedisServer(args.run_dir, args.redis_port)


def cmd_up(args: argparse.Namespace) -> None:
    cmd_fetch(args)
    kafka, redis = _services(args)

    t0 = time.monotonic()
    reused = redis.pid is not None and redis.is_healthy()
    _step(f"Redis on 127.0.0.1:{redis.port}")
    pid = redis.up(log=_step)
    _done(f"Redis {'already running' if reused else 'started'} (pid {pid}, {redis.url})", t0)

    t0 = time.monotonic()
    reused = kafka.pid is not None and kafka.is_healthy()
    _step(f"Kafka broker on {kafka.bootstrap_servers} (log: {kafka.log_path})")
    pid = kafka.up(args.timeout)
    _done(
        f"Kafka {'already running' if reused else 'ready'} (pid {pid}, bootstrap {kafka.bootstrap_servers})",
        t0,
    )


def cmd_setup(args: argparse.Namespace) -> None:
    """Every install step a fresh machine needs before anything starts (the venv is the Makefile's)."""
    t0 = time.monotonic()
    _step(f"java: {fetch.require_java()}")
    cmd_fetch(args)
    t1 = time.monotonic()
    fs_jar, fs_made = local_fs.ensure_local_fs_jar(args.cache_dir, log=_step)
    _done(f"processor local file system: {fs_jar.name} ({'compiled' if fs_made else 'cached'})", t1)
    archive, made = class_archive.ensure_class_archive(args.cache_dir, log=_step)
    _done(f"processor class archive: {archive.name} ({'made' if made else 'cached'})", t1)
    _step("redis-server (Debian package)")
    RedisServer(args.run_dir, args.redis_port).ensure_installed()
    _step("redis-sentinel (Debian package, for Redis failover in `make cluster` and its tests)")
    redis_sentinel.ensure_installed(log=_step)
    _step("chromium (Debian package, for the dashboard's browser test)")
    apt.CHROMIUM.ensure_installed(log=_step)
    _step("prometheus and prometheus-alertmanager (Debian packages, the monitoring stack)")
    apt.PROMETHEUS.ensure_installed(log=_step)
    apt.ALERTMANAGER.ensure_installed(log=_step)
    _step("ss (Debian package iproute2, for the tests that list a JVM's ports)")
    apt.SS.ensure_installed(log=_step)
    _done("set-up complete", t0)


def _run_dirs(run_dir: Path) -> list[Path]:
    """``run_dir`` and every run dir below it with pid files (the demo's .run/demo, the tests' ...)."""
    return [run_dir, *sorted(p.parent for p in run_dir.glob("*/pids"))]


def cmd_down(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    run_dirs = _run_dirs(args.run_dir) if args.all else [args.run_dir]
    stopped = [name for run_dir in run_dirs for name in procs.stop_all(run_dir)]
    _done(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}", t0)


def cmd_status(args: argparse.Namespace) -> None:
    """One table per run dir: --run-dir's own, then the ones below it that have processes (the demo)."""
    below = [d for d in _run_dirs(args.run_dir)[1:] if procs.known_names(d)]
    for run_dir in [args.run_dir, *below]:
        console.print(_status_table(args, run_dir))


def _process_table(title: str, first: str, *extra: str) -> Table:
    """A table of processes: ``first`` (their name), pid, port, RSS MB, alive, then ``extra`` columns."""
    table = Table(title=title)
    for col in (first, "pid", "port", "RSS MB", "alive", *extra):
        table.add_column(col, justify="right" if col in ("pid", "port", "RSS MB") else "left")
    return table


def _process_cells(pid: int | None, port: int | None, rss: float) -> list[str]:
    """The pid, port, RSS MB and alive cells of a process (``rss`` is read only when it runs)."""
    return [
        str(pid) if pid else "-",
        str(port) if port else "-",
        f"{rss:.0f}" if pid else "-",
        "[green]yes[/]" if pid else "[red]no[/]",
    ]


def _status_table(args: argparse.Namespace, run_dir: Path) -> Table:
    table = _process_table(f"infra status ({run_dir})", "component", "ready")
    names = ["kafka", "redis", *(n for n in procs.known_names(run_dir) if n not in ("kafka", "redis"))]
    for name in names:
        pid = procs.pid_of(name, run_dir)
        port = procs.recorded_port(name, run_dir)
        ready: bool | None = None
        if pid is not None:
            if name == "kafka":
                ready = KafkaBroker(run_dir, port or args.kafka_port).is_healthy()
            elif name == "redis":
                ready = RedisServer(run_dir, port or args.redis_port).is_healthy()
            elif port is not None:
                ready = procs.port_in_use(port)
        rss = procs.rss_mb(pid) if pid else 0.0
        readiness = "-" if ready is None else ("[green]yes[/]" if ready else "[red]no[/]")
        table.add_row(name, *_process_cells(pid, port, rss), readiness)
    return table


def cmd_pki(args: argparse.Namespace) -> None:
    """The project CA and the services' certificates for mutual TLS on gRPC (pki.py)."""
    t0 = time.monotonic()
    directory = (args.dir or args.run_dir / "pki").resolve()
    issued = pki.rotate(directory) if args.rotate else pki.ensure_pki(directory)
    what = f"issued {', '.join(issued)}" if issued else "every certificate is valid"
    _done(f"PKI in {directory}: {what} (services read it from SF_TLS_DIR)", t0)


def cmd_cluster(args: argparse.Namespace) -> None:
    """The multi-node topology of infra/cluster/: up, down or status."""
    from infra.cluster import topology

    cfg = topology.config(tests=args.tests)
    t0 = time.monotonic()
    if args.action == "down":
        stopped = topology.down(cfg)
        _done(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}", t0)
        return
    if args.action == "up":
        topology.up(cfg, _step)
        _done(f"cluster up in {cfg.run_dir}", t0)
    console.print(_cluster_table(cfg))
    if args.action == "up":
        token = cfg.run_dir / "control-token"
        console.print(
            f"control API {cfg.control_urls} (a leader and a standby: any serves reads, the leader "
            f"changes; bearer token in {token}); Kafka bootstrap {cfg.bootstrap}\n"
            f'submit a job:  curl -X POST {cfg.control_url}/jobs -H "Authorization: Bearer $(cat {token})" '
            "-H 'Content-Type: application/yaml' --data-binary @services/processor/examples/page_views.yaml\n"
            "stop it all:   make stop  (or python -m infra cluster down)"
        )


def _cluster_table(cfg: ClusterConfig) -> Table:
    from infra.cluster import topology

    k, master = topology.kafka(cfg), topology.spark_master(cfg)
    brokers = k.live_brokers()
    apps = [f"{a.get('name')} ({a.get('cores')} cores)" for a in master.applications()]
    alive = topology.registered(cfg)
    table = _process_table(f"cluster ({cfg.run_dir})", "process")
    total = 0.0
    for name, port in topology.processes(cfg):
        pid = procs.pid_of(name, cfg.run_dir)
        rss = procs.rss_mb(pid) if pid else 0.0
        total += rss
        table.add_row(name, *_process_cells(pid, port, rss))
    table.add_row("total", "", "", f"{total:.0f}", "")
    under = k.under_replicated() if brokers else ["?"]
    table.caption = (
        f"Kafka brokers in the cluster: {brokers or 'none'}; under-replicated partitions: {len(under)}. "
        f"Spark workers alive: {len(master.alive_workers())}; applications: "
        f"{', '.join(apps) or 'none'}. "
        f"Registered with control: {alive or 'nothing (control down?)'}"
    )
    return table


def cmd_smoke(args: argparse.Namespace) -> None:
    from infra.local import smoke

    kafka, redis = _services(args)
    smoke.run(kafka, redis, spark=args.spark, log=_step, cache_dir=args.cache_dir)
    console.print("[green]✓[/] smoke checks passed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m infra", description="Local Kafka + Redis for the platform."
    )
    parser.add_argument(
        "--run-dir", type=Path, default=RUN_DIR, help="data, logs and pid files (default: .run)"
    )
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--kafka-port", type=int, default=9092)
    parser.add_argument("--controller-port", type=int, default=9093)
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--kafka-heap", default=DEFAULT_HEAP)
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for the broker")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="resolve the Kafka, spark-sql-kafka and Zipkin jars into .cache (once)")
    sub.add_parser("up", help="fetch, then start Redis and Kafka and wait until they answer")
    sub.add_parser(
        "setup",
        help="check Java, fetch the jars, install redis-server, redis-sentinel and chromium when missing",
    )
    down = sub.add_parser(
        "down", help="stop every process with a pid file (services, then Zipkin, Redis, Kafka)"
    )
    down.add_argument("--all", action="store_true", help="also every run dir below --run-dir (demo, test)")
    pki_cmd = sub.add_parser("pki", help="make the CA and service certificates for gRPC mutual TLS")
    pki_cmd.add_argument("--dir", type=Path, default=None, help="where (default: <run-dir>/pki)")
    pki_cmd.add_argument("--rotate", action="store_true", help="new service certificates from the same CA")
    sub.add_parser("status", help="table of processes, ports, memory (of the run dirs below too)")
    cluster_cmd = sub.add_parser(
        "cluster",
        help="three Kafka nodes, Spark master + two workers, Redis, control, two of each other service",
    )
    cluster_cmd.add_argument("action", choices=("up", "down", "status"))
    cluster_cmd.add_argument(
        "--tests", action="store_true", help="the tests' cluster (.run/cluster-test*, ports 20700+)"
    )
    smoke = sub.add_parser("smoke", help="produce/consume (plain + transactional) and Redis checks")
    smoke.add_argument("--spark", action="store_true", help="also read the topic with Spark's Kafka source")
    return parser


COMMANDS = {
    "setup": cmd_setup,
    "fetch": cmd_fetch,
    "up": cmd_up,
    "down": cmd_down,
    "status": cmd_status,
    "pki": cmd_pki,
    "smoke": cmd_smoke,
    "cluster": cmd_cluster,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run_dir = args.run_dir.resolve()
    try:
        COMMANDS[args.command](args)
    except InfraError as e:
        err_console.print(f"[red]error:[/] {escape(str(e))}")
        return 1
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
