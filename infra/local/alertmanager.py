"""A private Alertmanager (Debian's ``prometheus-alertmanager``) run as a detached process on 127.0.0.1.

It routes every alert to control's webhook receiver (``POST /alerts/webhook``, with a bearer token of
the ``alerts`` scope), which keeps them for the API and the dashboard. Its gossip (cluster) port is
off: one Alertmanager, and the default cluster port would be a neighbour of Kafka's. Callers
authenticate with basic auth (monitoring_auth.py). It never reads /etc/prometheus.

Layout under run_dir:  alertmanager/alertmanager.yml (generated), alertmanager/data/ (silences,
notification log), logs/alertmanager.log, pids/alertmanager.pid.
"""

from __future__ import annotations

import subprocess
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

import yaml

from infra.artifacts.apt import ALERTMANAGER, AMTOOL
from infra.errors import InfraError
from infra.local import procs
from infra.local.monitoring_auth import ALERTMANAGER_USERS, MonitoringAuth
from infra.paths import logs_dir

NAME = "alertmanager"
# 9093 is the Debian default, and Kafka's controller port here.
DEFAULT_PORT = 9094


@dataclass(frozen=True)
class Grouping:
    """How long Alertmanager waits before it notifies of a new group, of a change in a group, and
    before it repeats a notification (seconds)."""

    wait_s: float = 30
    interval_s: float = 60
    repeat_s: float = 4 * 3600


DEFAULT_GROUPING = Grouping()
TEST_GROUPING = Grouping(wait_s=1, interval_s=1, repeat_s=3600)


def _seconds(value: float) -> str:
    return f"{int(value * 1000)}ms"


class Alertmanager:
    def __init__(
        self, run_dir: Path, port: int = DEFAULT_PORT, *, control_url: str, grouping: Grouping = Grouping()
    ) -> None:
        self.run_dir = run_dir
        self.port = port
        self.control_url = control_url
        self.grouping = grouping
        self.dir = run_dir / "alertmanager"
        self.data_dir = self.dir / "data"
        self.log_path = logs_dir(run_dir) / "alertmanager.log"
        self.auth = MonitoringAuth(run_dir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return procs.pid_of(NAME, self.run_dir)

    def config(self) -> dict[str, object]:
        g = self.grouping
        token = self.auth.secret_file("alertmanager-control-token", self.auth.token("alertmanager"))
        return {
            "route": {
                "receiver": "control",
                "group_by": ["alertname", "service", "job"],
                "group_wait": _seconds(g.wait_s),
                "group_interval": _seconds(g.interval_s),
                "repeat_interval": _seconds(g.repeat_s),
            },
            "receivers": [
                {
                    "name": "control",
                    "webhook_configs": [
                        {
                            "url": f"{self.control_url}/alerts/webhook",
                            "send_resolved": True,
                            "http_config": {
                                "authorization": {"type": "Bearer", "credentials_file": str(token)}
                            },
                        }
                    ],
                }
            ],
        }

    def argv(self, binary: str) -> list[str]:
        return [
            binary,
            f"--config.file={self.dir / 'alertmanager.yml'}",
            f"--web.config.file={self.auth.web_config('alertmanager', ALERTMANAGER_USERS)}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--storage.path={self.data_dir}",
            "--cluster.listen-address=",  # no gossip port: a single Alertmanager
            f"--web.external-url={self.url}",
        ]

    def write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        amtool = AMTOOL.ensure_installed()
        check = subprocess.run(
            [amtool, "check-config", str(path)], capture_output=True, text=True, check=False
        )
        if check.returncode != 0:
            raise InfraError(f"amtool refuses {path}:\n{check.stdout}{check.stderr}")
        return path

    def start(self) -> int:
        pid = self.pid
        if pid is not None:
            return pid
        procs.require_free_ports(
            [self.port], "alertmanager", self.run_dir, "choose another Alertmanager port"
        )
        binary = ALERTMANAGER.ensure_installed()
        self.write_config()
        return procs.start_process(
            NAME, self.argv(binary), self.run_dir, log_path=self.log_path, port=self.port
        )

    def authorization(self, user: str = "operator") -> str:
        raw = f"{user}:{self.auth.password('alertmanager', user)}".encode()
        return "Basic " + b64encode(raw).decode()

    def get(self, path: str, timeout_s: float = 5.0) -> bytes:
        """GET ``path`` of Alertmanager's API as the operator."""
        req = urllib.request.Request(f"{self.url}{path}", headers={"Authorization": self.authorization()})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body: bytes = resp.read()
            return body

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            self.get("/-/ready", timeout_s)
        except OSError:
            return False
        return True

    def wait_ready(self, timeout_s: float = 60) -> None:
        pid = self.pid
        if pid is None:
            raise InfraError(
                f"Alertmanager is not running; see {self.log_path}:\n{procs.tail(self.log_path)}"
            )
        procs.wait_for(self.is_healthy, timeout_s, f"Alertmanager on {self.url}", self.log_path, pid=pid)

    def up(self, timeout_s: float = 60) -> int:
        pid = self.start()
        self.wait_ready(timeout_s)
        return pid

    def stop(self, timeout_s: float = 20) -> bool:
        return procs.stop_process(NAME, self.run_dir, timeout_s)
