"""The API key, checked before anything else: a request without it gets a 401 before its body
is read.

:class:`ApiKeyGate` is the outermost middleware: it reads the ``Authorization`` header from
the ASGI scope and answers a missing or wrong key at once, so an unauthenticated client costs
neither the body bound's buffering (up to ``max_body_bytes``) nor JSON parsing.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from kvboost_rag.server.errors import APIError

#: Paths open without the key: load balancers' health checks.
OPEN_PATHS = frozenset({"/health"})


def bearer_key_valid(authorization: str, expected: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <expected>`` (compared in
    constant time)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())


def invalid_api_key() -> APIError:
    """The 401 ``invalid_api_key`` of a missing or wrong key."""
    return APIError(
        401,
        "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer <key>'",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class ApiKeyGate:
    """ASGI middleware answering HTTP requests without the API key with a 401, their body
    unread.

    Args:
        app: The wrapped application.
        api_key: The key every request needs (``None``: none; every request passes).
        open_paths: Paths that need no key (``/health``, the API docs).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: Iterable[str] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)

    def _allowed(self, scope: Scope) -> bool:
        if self.api_key is None or scope["type"] != "http" or scope.get("path") in self.open_paths:
            return True
        authorization = dict(scope.get("headers") or []).get(b"authorization", b"")
        return bearer_key_valid(authorization.decode("latin-1"), self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await invalid_api_key().response()(scope, receive, send)
