"""Zipkin's server (the tracing UI and its span collector) run from its exec jar as a detached process.

The jar is resolved from Maven Central once (io.zipkin:zipkin-server:<v>:exec, infra/artifacts/fetch.py)
and then served from the cache. Spans are kept in memory only (capped by MEM_MAX_SPANS), which suits a
demo and the tests: a restart starts with an empty UI.

Layout under run_dir:  logs/zipkin.log (server log), pids/zipkin.pid.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from infra.artifacts.fetch import CACHE_DIR, require_java, zipkin_jar
from infra.errors import InfraError
from infra.local import procs
from infra.local.jvm import checked_memory, private_tmpdir
from infra.paths import logs_dir

NAME = "zipkin"
DEFAULT_PORT = 9411
SPANS_PATH = "/api/v2/spans"


class ZipkinServer:
    """Zipkin on 127.0.0.1:port with in-memory storage. up() reuses ours if it is already running."""

    def __init__(
        self,
        run_dir: Path,
        port: int = DEFAULT_PORT,
        heap: str = "320m",
        max_spans: int = 200_000,
        *,
        cache_dir: Path = CACHE_DIR,
    ) -> None:
        self.run_dir = run_dir
        self.port = port
        self.heap = checked_memory(heap, "the zipkin heap")
        self.max_spans = max_spans
        self.cache_dir = cache_dir
        self.log_path = logs_dir(run_dir) / "zipkin.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"{self.base_url}/zipkin/"

    @property
    def spans_endpoint(self) -> str:
        """Where exporters POST spans (Zipkin v2 JSON): the value of SF_TRACING_ENDPOINT."""
        return self.base_url + SPANS_PATH

    @property
    def pid(self) -> int | None:
        return procs.pid_of(NAME, self.run_dir)

    def jvm_options(self) -> list[str]:
        return [
            "-Xms64m",
            f"-Xmx{self.heap}",
            # A UI and an in-memory store: the serial collector and C1 only start fast and stay small
            # on a 2-core machine shared with Kafka and Spark.
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            "-Dspring.main.banner-mode=off",
        ]

    def server_args(self) -> list[str]:
        # Armeria serves the UI, the API and the collector on one port; bind it to loopback only.
        return [
            "--armeria.ports[0].ip=127.0.0.1",
            f"--armeria.ports[0].port={self.port}",
            "--armeria.ports[0].protocols[0]=http",
        ]

    def environment(self) -> dict[str, str]:
        return {
            "STORAGE_TYPE": "mem",
            "MEM_MAX_SPANS": str(self.max_spans),
            "SELF_TRACING_ENABLED": "false",
            # Only the HTTP collector is used; the others would only start when configured anyway.
            "COLLECTOR_KAFKA_ENABLED": "false",
            "COLLECTOR_RABBITMQ_ENABLED": "false",
            "COLLECTOR_ACTIVEMQ_ENABLED": "false",
            "COLLECTOR_PULSAR_ENABLED": "false",
            "COLLECTOR_GRPC_ENABLED": "false",
        }

    def start(self) -> int:
        """Start Zipkin (or return the pid of ours if it is already running). Does not wait."""
        pid = self.pid
        if pid is not None:
            return pid
        procs.require_free_ports([self.port], "Zipkin", self.run_dir, "choose another Zipkin port")
        jar = zipkin_jar(self.cache_dir)
        tmpdir = private_tmpdir(self.run_dir / "zipkin-tmp")
        argv = [require_java(), *self.jvm_options(), tmpdir, "-jar", str(jar), *self.server_args()]
        return procs.start_process(
            NAME, argv, self.run_dir, env=self.environment(), log_path=self.log_path, port=self.port
        )

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """True when /health says UP (Armeria answers it once the collector and storage are ready)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout_s) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError):
            return False
        return isinstance(body, dict) and body.get("status") == "UP"

    def trace(self, trace_id: str, services: set[str], timeout_s: float = 30) -> list[Any]:
        """The trace as Zipkin's own API returns it, once spans of all ``services`` have arrived
        (or whatever it holds at the deadline)."""
        spans: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base_url}/api/v2/trace/{trace_id}", timeout=5) as resp:
                    spans = json.loads(resp.read())
            except OSError:  # 404 until the first span of the trace arrives
                pass
            else:
                if services <= {s["localEndpoint"]["serviceName"] for s in spans}:
                    return spans
            time.sleep(0.5)
        return spans

    def wait_ready(self, timeout_s: float = 90) -> None:
        pid = self.pid
        if pid is None:
            raise InfraError(f"Zipkin is not running; see {self.log_path}:\n{procs.tail(self.log_path)}")
        procs.wait_for(
            self.is_healthy, timeout_s, f"Zipkin on {self.base_url}", self.log_path, pid=pid, interval_s=0.5
        )

    def up(self, timeout_s: float = 90) -> int:
        pid = self.start()
        self.wait_ready(timeout_s)
        return pid

    def stop(self, timeout_s: float = 20) -> bool:
        """SIGTERM (Spring shuts down), SIGKILL after timeout_s. True if it was running."""
        return procs.stop_process(NAME, self.run_dir, timeout_s)
