"""Zipkin as infra runs it: the exec jar from the cache, one server per run dir, its API answering."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from infra.artifacts.fetch import fetch_zipkin, zipkin_jar
from infra.errors import InfraError
from infra.local.zipkin import ZipkinServer

pytestmark = pytest.mark.integration


def test_the_exec_jar_is_resolved_once_then_served_from_the_cache() -> None:
    fetch_zipkin(log=lambda _msg: None)  # fetches only on a cold cache
    again = fetch_zipkin(log=lambda _msg: None)
    assert not again.fetched and again.versions == {"zipkin.version": "3.6.1"}
    jar = zipkin_jar(log=lambda _msg: None)
    assert jar.name == "zipkin-server-3.6.1-exec.jar" and jar.stat().st_size > 50_000_000


def test_the_running_server_answers_and_is_reused_not_duplicated(
    zipkin: ZipkinServer, tmp_path: Path
) -> None:
    pid = zipkin.pid
    assert pid is not None and zipkin.start() == pid  # start() of a running server is a no-op
    resp = httpx.get(f"{zipkin.base_url}/api/v2/services", timeout=5)
    assert resp.status_code == 200 and isinstance(resp.json(), list)
    assert httpx.get(zipkin.ui_url, timeout=5).status_code == 200
    # Another run dir cannot start a second server on the same port: it is told why.
    with pytest.raises(InfraError, match="already in use"):
        ZipkinServer(tmp_path, port=zipkin.port).start()
