"""Token scopes and the auth policy, without a server; settings that must fail fast."""

from __future__ import annotations

import pytest
from fastapi import HTTPException
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import ValidationError

from services.control.api.auth import authorize, scopes_of
from services.control.settings import ControlSettings, ControlTuning, Scope

TOKENS = {"admin-token-1": ["read", "write"], "viewer-token-1": ["read"]}


def creds(token: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)


def refused(settings: ControlSettings, token: str | None, scope: Scope) -> tuple[int, str] | None:
    try:
        authorize(settings, creds(token) if token else None, scope, "POST /jobs")
    except HTTPException as e:
        return e.status_code, str(e.detail)
    return None


def test_scopes_of_tokens() -> None:
    settings = ControlSettings(tokens=TOKENS)
    assert scopes_of(settings, "admin-token-1") == {Scope.READ, Scope.WRITE}
    assert scopes_of(settings, "viewer-token-1") == {Scope.READ}
    assert scopes_of(settings, "admin-token") is None
    assert scopes_of(settings, "") is None


def test_policy_with_tokens() -> None:
    settings = ControlSettings(tokens=TOKENS)
    assert refused(settings, "admin-token-1", Scope.WRITE) is None
    assert refused(settings, "viewer-token-1", Scope.READ) is None
    code, msg = refused(settings, "viewer-token-1", Scope.WRITE) or (0, "")
    assert code == 403 and "'write' scope" in msg
    assert (refused(settings, None, Scope.READ) or (0,))[0] == 401
    assert (refused(settings, "guess-1234", Scope.READ) or (0,))[0] == 401


def test_default_is_secure_and_the_switch_is_explicit() -> None:
    default = ControlSettings()
    assert not default.auth_disabled and not default.tokens
    code, msg = refused(default, None, Scope.WRITE) or (0, "")
    assert code == 401 and "SF_CONTROL_TOKENS" in msg
    assert refused(default, None, Scope.READ) is None  # no tokens: reads are open
    disabled = ControlSettings(auth_disabled=True)
    assert refused(disabled, None, Scope.WRITE) is None


def test_tokens_from_the_environment_are_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SF_CONTROL_TOKENS", '{"env-token-123": ["read"]}')
    settings = ControlSettings()
    assert scopes_of(settings, "env-token-123") == {Scope.READ}
    assert "env-token-123" not in repr(settings)


def test_tuning_comes_from_sf_control_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SF_CONTROL_TUNING", '{"heartbeat_interval_ms": 500, "max_restarts": 1}')
    tuning = ControlSettings().tuning
    assert (tuning.heartbeat_interval_ms, tuning.max_restarts) == (500, 1)
    monkeypatch.delenv("SF_CONTROL_TUNING")
    assert ControlSettings().tuning == ControlTuning()


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"tokens": {"short": ["read"]}}, "at least 8 characters"),
        ({"tokens": {"long-enough-1": []}}, "at least one scope"),
        ({"tokens": {"long-enough-1": ["admin"]}}, "'read', 'write' or 'alerts'"),
        (
            {"tuning_overrides": {"heartbeat_interval_ms": 1000}, "heartbeat_timeout_ms": 900},
            "must exceed heartbeat_interval_ms",
        ),
        ({"tuning_overrides": {"heartbeat_interval_ms": 6_000}}, "must exceed heartbeat_interval_ms"),
        ({"tuning_overrides": {"heartbeat_interval_ms": 10}}, "greater than or equal to 50"),
        ({"tuning_overrides": {"heartbeat_intervl_ms": 500}}, "unknown tuning"),
        ({"port": 70000}, "less than or equal to 65535"),
    ],
)
def test_bad_settings_fail_fast_without_echoing_tokens(values: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        ControlSettings(**values)  # type: ignore[arg-type]
    assert fragment in str(err.value)
    assert "short" not in str(err.value).replace("at least", "")
