"""Detached-process helpers: start, track (pid files), stop, and measure local processes.

Every process gets its own session (start_new_session=True) so it outlives the CLI that started it and
so stopping it can signal its whole process group (e.g. a PySpark driver together with its JVM).

Layout under a run dir:  pids/<name>.pid (the pid, one line), pids/<name>.port (optional, for `status`),
logs/<name>.log (stdout+stderr, unless a log path is given).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.errors import InfraError
from infra.paths import ROOT, logs_dir, pids_dir

# Stopped after the services, in this order: Prometheus and Alertmanager (they watch the services),
# Spark once its applications (processors) are gone, Zipkin once the services flushed their last
# spans, Redis's Sentinels before the nodes they would otherwise fail over, Kafka last. Each group is a
# name and its numbered replicas (``kafka``, ``kafka-1``...), stopped together.
INFRA_STOP_ORDER = (
    "prometheus",
    "alertmanager",
    "spark-worker",
    "spark-master",
    "zipkin",
    "redis-sentinel",
    "redis",
    "kafka",
)


@dataclass(frozen=True)
class Host:
    """Where a process runs: the address its servers bind to and advertise, and the network
    namespace it runs in ("": this machine's own, where everything listens on loopback)."""

    address: str = "127.0.0.1"
    netns: str = ""


LOOPBACK = Host()

# Popen objects of children started by this Python process. Keeping them referenced lets us reap them
# (no zombies that would look alive) and avoids "subprocess is still running" ResourceWarnings.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def pid_file(name: str, run_dir: Path) -> Path:
    return pids_dir(run_dir) / f"{name}.pid"


def port_file(name: str, run_dir: Path) -> Path:
    return pids_dir(run_dir) / f"{name}.port"


def log_file(name: str, run_dir: Path) -> Path:
    return logs_dir(run_dir) / f"{name}.log"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is the state), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return raw[raw.rindex(")") + 2 :].split()


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise InfraError("cannot read boot time from /proc/stat")


def _start_time(pid: int) -> float | None:
    """Process start time as a Unix timestamp (None if the process is gone)."""
    fields = _proc_stat(pid)
    if fields is None:
        return None
    ticks = int(fields[19])  # field 22 of stat overall; index 19 once pid and comm are dropped
    return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[pid]  # reaped: our own child has exited
        return False
    fields = _proc_stat(pid)
    if fields is None or fields[0] == "X":
        return False
    if fields[0] != "Z":
        return True
    # A zombie leader with live threads is still running: the JVM's main thread exits early during
    # shutdown while the shutdown hooks keep going. Only when every thread is a zombie is it gone.
    # A thread reaped between listing and reading answers ENOENT or ESRCH: it is gone either way.
    try:
        tasks = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except (FileNotFoundError, ProcessLookupError):
        return False
    for tid in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X"):
            return True
    return False


def pid_of(name: str, run_dir: Path) -> int | None:
    """Pid recorded for `name` if that process is still running, else None.

    A pid file whose process started clearly after the file was written belongs to a recycled pid
    (e.g. after a reboot) and is treated as stale.
    """
    path = pid_file(name, run_dir)
    try:
        pid = int(path.read_text().split()[0])
        written = path.stat().st_mtime
    except (FileNotFoundError, ValueError, IndexError):
        return None
    if not _alive(pid):
        return None
    started = _start_time(pid)
    if started is None or started > written + 5:
        return None
    return pid


def started_at(name: str, run_dir: Path) -> float | None:
    """When process ``name`` of ``run_dir`` started (a Unix timestamp), or None if it is not running."""
    pid = pid_of(name, run_dir)
    return _start_time(pid) if pid is not None else None


def is_running(name: str, run_dir: Path) -> bool:
    return pid_of(name, run_dir) is not None


def recorded_port(name: str, run_dir: Path) -> int | None:
    try:
        return int(port_file(name, run_dir).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def known_names(run_dir: Path) -> list[str]:
    """Names with a pid file in run_dir (running or stale), sorted."""
    directory = pids_dir(run_dir)
    return sorted(p.stem for p in directory.glob("*.pid")) if directory.is_dir() else []


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def start_process(
    name: str,
    argv: Sequence[str | os.PathLike[str]],
    run_dir: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    *,
    log_path: Path | None = None,
    port: int | None = None,
    host: Host = LOOPBACK,
) -> int:
    """Start argv detached (own session, stdin closed, stdout+stderr appended to the log); return its pid.

    env: extra variables layered over the inherited environment (PYTHONUNBUFFERED=1 is added so Python
    services' logs are written as they happen). port: recorded for `python -m infra status` only.
    host: a network namespace to run it in (``ip netns exec`` execs argv: the pid is argv's).
    Raises InfraError if a process of that name is already running or the executable does not start.
    """
    existing = pid_of(name, run_dir)
    if existing is not None:
        raise InfraError(
            f"{name} is already running (pid {existing}, pid file {pid_file(name, run_dir)}); stop it first"
        )
    log_path = log_path or log_file(name, run_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pids_dir(run_dir).mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if host.netns:
        argv = ["ip", "netns", "exec", host.netns, *argv]
    with log_path.open("ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {name}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                [os.fspath(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=child_env,
                start_new_session=True,
            )
        except OSError as e:
            raise InfraError(f"cannot start {name} ({argv[0]}): {e}") from e
    _CHILDREN[proc.pid] = proc
    _write_atomic(pid_file(name, run_dir), f"{proc.pid}\n")
    if port is not None:
        _write_atomic(port_file(name, run_dir), f"{port}\n")
    return proc.pid


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # Signal the whole group when pid leads one (it does when started by start_process), so helper
    # children such as a PySpark driver's JVM go down with it.
    with contextlib.suppress(ProcessLookupError):
        try:
            leads_group = os.getpgid(pid) == pid
        except ProcessLookupError:
            return
        if leads_group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def send_signal(name: str, run_dir: Path, sig: signal.Signals) -> bool:
    """Signal process ``name``'s group; False if it is not running."""
    pid = pid_of(name, run_dir)
    if pid is None:
        return False
    _signal_group(pid, sig)
    return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _forget(name: str, run_dir: Path) -> None:
    for path in (pid_file(name, run_dir), port_file(name, run_dir)):
        path.unlink(missing_ok=True)


def stop_process(name: str, run_dir: Path, timeout_s: float = 20) -> bool:
    """SIGTERM the process (group), SIGKILL it after timeout_s; True if something was running."""
    pid = pid_of(name, run_dir)
    if pid is None:
        _forget(name, run_dir)  # stale or absent pid file
        return False
    _signal_group(pid, signal.SIGTERM)
    if not _wait_gone(pid, timeout_s):
        _signal_group(pid, signal.SIGKILL)
        if not _wait_gone(pid, 5):
            raise InfraError(f"{name} (pid {pid}) survived SIGKILL; check `ps -o pid,stat,cmd -p {pid}`")
    _forget(name, run_dir)
    return True


def kill_process(name: str, run_dir: Path, timeout_s: float = 5) -> bool:
    """SIGKILL the process (group) at once, as a crash would end it; True if something was running."""
    pid = pid_of(name, run_dir)
    if pid is None:
        _forget(name, run_dir)
        return False
    _signal_group(pid, signal.SIGKILL)
    if not _wait_gone(pid, timeout_s):
        raise InfraError(f"{name} (pid {pid}) survived SIGKILL; check `ps -o pid,stat,cmd -p {pid}`")
    _forget(name, run_dir)
    return True


def stop_many(names: Sequence[str], run_dir: Path, timeout_s: float = 20) -> list[str]:
    """Like stop_process for several processes at once: SIGTERM to all, then wait for each (SIGKILL
    after timeout_s). For peers whose shutdown needs each other, such as the nodes of a Kafka quorum.
    Returns the names that were running."""
    running = set()
    if len(names) > 1:
        for name in names:
            pid = pid_of(name, run_dir)
            if pid is not None:
                _signal_group(pid, signal.SIGTERM)
                running.add(name)
    # Each then waited for (and SIGKILLed if need be) as on its own; the SIGTERM again is harmless.
    return [n for n in names if stop_process(n, run_dir, timeout_s) or n in running]


def infra_group(name: str) -> str | None:
    """The INFRA_STOP_ORDER group ``name`` belongs to (``kafka-2`` -> ``kafka``), None for a service."""
    for group in INFRA_STOP_ORDER:
        if name == group or (name.startswith(f"{group}-") and name[len(group) + 1 :].isdigit()):
            return group
    return None


def stop_all(run_dir: Path, timeout_s: float = 20) -> list[str]:
    """Stop every process with a pid file in run_dir: services first (one by one), then the
    infrastructure groups in INFRA_STOP_ORDER (each group at once), Kafka last.

    Returns the names that were actually running.
    """
    names = known_names(run_dir)
    stopped = [n for n in names if infra_group(n) is None and stop_process(n, run_dir, timeout_s)]
    for group in INFRA_STOP_ORDER:
        members = [n for n in names if infra_group(n) == group]
        if members:
            stopped += stop_many(members, run_dir, timeout_s)
    return stopped


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on host:port or the port cannot be bound there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        if s.connect_ex((host, port)) == 0:
            return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR so sockets in TIME_WAIT from a previous run don't count as "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listening(port: int, host: Host = LOOPBACK) -> bool:
    """Something on ``host`` accepts connections on ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host.address, port)) == 0


def require_free_ports(
    ports: Sequence[int], owner: str, run_dir: Path, advice: str, host: Host = LOOPBACK
) -> None:
    """InfraError naming the first of ``ports`` that something other than ``owner`` of ``run_dir``
    holds (the caller has checked that its own process is not running); ``advice`` ends the message.
    On a host of its own (a namespace) a port is taken when something answers on it."""
    for port in ports:
        if listening(port, host) if host.netns else port_in_use(port):
            raise InfraError(
                f"port {port} is already in use by another process (not the {owner} of {run_dir}); "
                f"stop it (see `ss -ltnp 'sport = :{port}'`) or {advice}"
            )


def tail(path: Path | None, lines: int = 20) -> str:
    """Last lines of a (possibly large or missing) text file."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except FileNotFoundError:
        return f"(no log file {path})"
    return "\n".join(data.splitlines()[-lines:])


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    log_path: Path | None = None,
    *,
    pid: int | None = None,
    interval_s: float = 0.5,
) -> None:
    """Poll predicate until it returns True; raise InfraError with the log's tail on timeout.

    If pid is given, fail as soon as that process exits instead of waiting out the timeout.
    An InfraError raised by predicate aborts the wait (use it for "this will never succeed"); other
    exceptions count as "not yet" and the last one is reported on timeout.
    """
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            if predicate():
                return
        except InfraError:
            raise
        except Exception as e:
            last_error = f"{type(e).__name__}: {e}"
        if pid is not None and not _alive(pid):
            problem = f"{what}: process {pid} exited"
            break
        if time.monotonic() >= deadline:
            problem = f"{what} not ready within {timeout_s:g} s"
            break
        time.sleep(interval_s)
    msg = problem
    if last_error:
        msg += f" (last check: {last_error})"
    if log_path is not None:
        msg += f"; see {log_path}, last lines:\n{tail(log_path)}"
    raise InfraError(msg)


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def rss_mb(pid: int, include_children: bool = True) -> float:
    """Resident memory of pid (plus its descendants) in MiB; 0.0 if it is gone."""
    todo, total_kb = [pid], 0
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
                break
        if include_children:
            todo.extend(children_of(current))
    return total_kb / 1024
