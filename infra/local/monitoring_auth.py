"""The credentials of Prometheus and Alertmanager and of their calls to control, one set per run dir.

Nothing in the monitoring stack serves a caller it has not authenticated: Prometheus and Alertmanager
answer only basic-auth users (their ``--web.config.file``, passwords stored as bcrypt hashes), and
control answers Prometheus's service discovery and Alertmanager's webhook only with their bearer tokens
(``read``, and ``alerts`` which may post alerts and nothing else). Everything is generated on first
use and kept 0600 under ``<run_dir>/monitoring-auth/``; the files named ``*.secret`` are what
Prometheus and Alertmanager read their credentials from.
"""

from __future__ import annotations

import json
import os
import secrets
import warnings
from pathlib import Path

# The basic-auth users of each server: an operator, and the one client each has.
PROMETHEUS_USERS = ("operator", "control")  # control's dashboard queries Prometheus
ALERTMANAGER_USERS = ("operator", "prometheus")  # Prometheus sends the alerts
# Bearer tokens control accepts from the monitoring stack, and their scopes.
CONTROL_TOKENS = {"prometheus": ["read"], "alertmanager": ["alerts"]}


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash of ``password``, as Prometheus's and Alertmanager's web config want it."""
    with warnings.catch_warnings():
        # crypt is glibc's (libxcrypt) bcrypt; this is set-up code, never on a service's path.
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 10))


class MonitoringAuth:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "monitoring-auth"

    def _secrets(self) -> dict[str, str]:
        path = self.dir / "secrets.json"
        try:
            known: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        names = [
            *(f"prometheus:{u}" for u in PROMETHEUS_USERS),
            *(f"alertmanager:{u}" for u in ALERTMANAGER_USERS),
            *(f"token:{t}" for t in CONTROL_TOKENS),
        ]
        if set(known) != set(names):
            known = {n: known.get(n) or secrets.token_urlsafe(24) for n in names}
            _write_private(path, json.dumps(known))
        return known

    def password(self, server: str, user: str) -> str:
        """The basic-auth password of ``user`` on ``server`` (``prometheus`` or ``alertmanager``)."""
        return self._secrets()[f"{server}:{user}"]

    def token(self, client: str) -> str:
        """The bearer token ``client`` (``prometheus`` or ``alertmanager``) sends to control."""
        return self._secrets()[f"token:{client}"]

    def control_tokens(self) -> dict[str, list[str]]:
        """Token -> scopes, for control's SF_CONTROL_TOKENS."""
        return {self.token(c): scopes for c, scopes in CONTROL_TOKENS.items()}

    def secret_file(self, name: str, value: str) -> Path:
        """``value`` in a 0600 file the server reads a credential from (rewritten when it changed)."""
        path = self.dir / f"{name}.secret"
        try:
            if path.read_text() == value:
                return path
        except OSError:
            pass
        _write_private(path, value)
        return path

    def web_config(self, server: str, users: tuple[str, ...]) -> Path:
        """The server's --web.config.file: its users with bcrypt hashes of their passwords."""
        lines = ["basic_auth_users:"]
        lines += [f"  {u}: '{bcrypt_hash(self.password(server, u))}'" for u in users]
        path = self.dir / f"{server}-web.yml"
        _write_private(path, "\n".join(lines) + "\n")
        return path


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
