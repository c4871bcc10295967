"""Bearer tokens with read and write scopes (see ControlSettings for the policy and its switches)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from services.control.settings import ControlSettings, Scope

bearer = HTTPBearer(
    auto_error=False,
    description="A token from SF_CONTROL_TOKENS; reads need the read scope, changes the write scope.",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def scopes_of(settings: ControlSettings, token: str) -> set[Scope] | None:
    """The scopes of a token, or None if it is not one of ours (compared in constant time)."""
    found: set[Scope] | None = None
    for known, scopes in settings.tokens.items():
        # Check every token, not just until a match, so timing does not tell which one matched.
        if hmac.compare_digest(known.get_secret_value().encode(), token.encode()):
            found = set(scopes)
    return found


def authorize(
    settings: ControlSettings, credentials: HTTPAuthorizationCredentials | None, scope: Scope, what: str
) -> None:
    if settings.auth_disabled:
        return
    if not settings.tokens:
        if scope == Scope.READ:
            return  # nothing configured: reads are open, changes are not
        raise HTTPException(
            401,
            "this control plane has no API tokens configured, so it refuses every change: set "
            'SF_CONTROL_TOKENS=\'{"<token>": ["read", "write"]}\' (or SF_CONTROL_AUTH_DISABLED=true '
            "for a local demo) and send 'Authorization: Bearer <token>'",
            headers=_CHALLENGE,
        )
    if credentials is None:
        raise HTTPException(
            401, f"{what} needs a bearer token: send 'Authorization: Bearer <token>'", headers=_CHALLENGE
        )
    scopes = scopes_of(settings, credentials.credentials)
    if scopes is None:
        raise HTTPException(
            401, "the bearer token is not valid: use one of SF_CONTROL_TOKENS", headers=_CHALLENGE
        )
    if scope not in scopes:
        raise HTTPException(
            403, f"{what} needs a token with the '{scope}' scope; this token has {sorted(scopes)}"
        )


def require_read(request: Request, credentials: Credentials) -> None:
    authorize(request.app.state.settings, credentials, Scope.READ, f"{request.method} {request.url.path}")


def require_write(request: Request, credentials: Credentials) -> None:
    authorize(request.app.state.settings, credentials, Scope.WRITE, f"{request.method} {request.url.path}")


def token_owner(request: Request) -> str:
    """Who submits, for the per-token limits: a digest of the request's bearer token ("" without one),
    never the token itself."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return hashlib.sha256(token.strip().encode()).hexdigest()[:12]


AUTH_RESPONSES: dict[int | str, dict[str, object]] = {
    401: {"description": "no valid bearer token"},
    403: {"description": "the token lacks the scope"},
}
