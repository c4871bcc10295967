"""A private Prometheus server (Debian's ``prometheus`` package) run as a detached process on 127.0.0.1.

It discovers what to scrape from control (HTTP service discovery of ``/monitoring/targets``: every
registered instance and control itself, so replicas and restarts appear by themselves), evaluates the
rules of infra/monitoring/rules/ and sends alerts to our Alertmanager. Callers authenticate with basic
auth (monitoring_auth.py). Our server never reads /etc/prometheus or the packaged service's data.

Layout under run_dir:  prometheus/prometheus.yml (generated), prometheus/data/ (the TSDB),
logs/prometheus.log, pids/prometheus.pid.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra.artifacts.apt import PROMETHEUS, PROMTOOL
from infra.errors import InfraError
from infra.local import procs
from infra.local.monitoring_auth import PROMETHEUS_USERS, MonitoringAuth
from infra.paths import INFRA_DIR, logs_dir

NAME = "prometheus"
DEBIAN_DEFAULT_PORT = 9090
RULES_DIR = INFRA_DIR / "monitoring" / "rules"
# The share of the free disk space under the run dir the TSDB may fill, within these bounds.
RETENTION_SHARE = 0.10
RETENTION_MIN_BYTES = 256 << 20
RETENTION_MAX_BYTES = 8 << 30
RETENTION_TIME = "15d"


@dataclass(frozen=True)
class Intervals:
    """How often Prometheus scrapes, evaluates rules and asks control for targets (seconds)."""

    scrape_s: float = 15
    evaluation_s: float = 15
    discovery_s: float = 15


DEFAULT_INTERVALS = Intervals()
# The tests' intervals: an alert fires within seconds of its rule's `for`, not a minute later.
TEST_INTERVALS = Intervals(scrape_s=1, evaluation_s=1, discovery_s=1)


def retention_bytes(path: Path) -> int:
    """How much the TSDB may keep: a share of the free space of the disk holding ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    return int(min(RETENTION_MAX_BYTES, max(RETENTION_MIN_BYTES, free * RETENTION_SHARE)))


def _seconds(value: float) -> str:
    return f"{int(value * 1000)}ms"


class PrometheusServer:
    def __init__(
        self,
        run_dir: Path,
        port: int = DEBIAN_DEFAULT_PORT,
        *,
        control_url: str,
        alertmanager_port: int,
        intervals: Intervals = Intervals(),
    ) -> None:
        self.run_dir = run_dir
        self.port = port
        self.control_url = control_url
        self.alertmanager_port = alertmanager_port
        self.intervals = intervals
        self.dir = run_dir / "prometheus"
        self.data_dir = self.dir / "data"
        self.log_path = logs_dir(run_dir) / "prometheus.log"
        self.auth = MonitoringAuth(run_dir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return procs.pid_of(NAME, self.run_dir)

    def config(self) -> dict[str, object]:
        """prometheus.yml: control's discovery, the repository's rules, our Alertmanager."""
        i = self.intervals
        sd_token = self.auth.secret_file("prometheus-control-token", self.auth.token("prometheus"))
        am_password = self.auth.secret_file(
            "alertmanager-prometheus-password", self.auth.password("alertmanager", "prometheus")
        )
        return {
            "global": {
                "scrape_interval": _seconds(i.scrape_s),
                "scrape_timeout": _seconds(min(i.scrape_s, 10)),
                "evaluation_interval": _seconds(i.evaluation_s),
            },
            "rule_files": [str(RULES_DIR / "*.rules.yml")],
            "alerting": {
                "alertmanagers": [
                    {
                        "static_configs": [{"targets": [f"127.0.0.1:{self.alertmanager_port}"]}],
                        "basic_auth": {"username": "prometheus", "password_file": str(am_password)},
                    }
                ]
            },
            "scrape_configs": [
                {
                    "job_name": "streamforge",
                    # The services' own `job` label names a StreamForge job: it must win over the
                    # scrape job's name (metrics without one get "streamforge").
                    "honor_labels": True,
                    "http_sd_configs": [
                        {
                            "url": f"{self.control_url}/monitoring/targets",
                            "refresh_interval": _seconds(i.discovery_s),
                            "authorization": {"type": "Bearer", "credentials_file": str(sd_token)},
                        }
                    ],
                }
            ],
        }

    def argv(self, binary: str) -> list[str]:
        return [
            binary,
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--web.config.file={self.auth.web_config('prometheus', PROMETHEUS_USERS)}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--storage.tsdb.retention.time={RETENTION_TIME}",
            f"--storage.tsdb.retention.size={retention_bytes(self.data_dir) >> 20}MB",
            # Its packaged console templates are not ours to serve.
            "--web.console.templates=",
            "--web.console.libraries=",
        ]

    def write_config(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "prometheus.yml"
        path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        promtool = PROMTOOL.ensure_installed()
        check = subprocess.run(
            [promtool, "check", "config", str(path)], capture_output=True, text=True, check=False
        )
        if check.returncode != 0:
            raise InfraError(f"promtool refuses {path}:\n{check.stdout}{check.stderr}")
        return path

    def start(self) -> int:
        """Start Prometheus (or return the pid of ours if it is already running). Does not wait."""
        pid = self.pid
        if pid is not None:
            return pid
        advice = "choose another Prometheus port"
        if self.port == DEBIAN_DEFAULT_PORT:
            advice += " (a system service? `service prometheus stop`)"
        procs.require_free_ports([self.port], "prometheus", self.run_dir, advice)
        binary = PROMETHEUS.ensure_installed()
        self.write_config()
        argv = self.argv(binary)
        return procs.start_process(NAME, argv, self.run_dir, log_path=self.log_path, port=self.port)

    def authorization(self, user: str = "operator") -> str:
        raw = f"{user}:{self.auth.password('prometheus', user)}".encode()
        return "Basic " + b64encode(raw).decode()

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        req = urllib.request.Request(f"{self.url}/-/ready", headers={"Authorization": self.authorization()})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 60) -> None:
        pid = self.pid
        if pid is None:
            raise InfraError(f"Prometheus is not running; see {self.log_path}:\n{procs.tail(self.log_path)}")
        procs.wait_for(self.is_healthy, timeout_s, f"Prometheus on {self.url}", self.log_path, pid=pid)

    def up(self, timeout_s: float = 60) -> int:
        pid = self.start()
        self.wait_ready(timeout_s)
        return pid

    def stop(self, timeout_s: float = 20) -> bool:
        return procs.stop_process(NAME, self.run_dir, timeout_s)
