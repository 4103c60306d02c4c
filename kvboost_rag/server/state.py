"""What every endpoint reads: the engine, the server's settings, admission, model names."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from kvboost_rag import KVBoost
from kvboost_rag.server.admission import Admission
from kvboost_rag.server.auth import bearer_key_valid, invalid_api_key
from kvboost_rag.server.errors import APIError
from kvboost_rag.server.settings import ServerSettings


@dataclass
class ServerState:
    """The server's parts, on ``app.state.kvboost``.

    Attributes:
        engine: The engine every request runs on.
        settings: The server's settings.
        admission: The bound on requests held at once.
        model_names: Names requests may give as ``model``.
        started: Unix time the server started (the models' ``created``).
    """

    engine: KVBoost
    settings: ServerSettings
    admission: Admission
    model_names: tuple[str, ...]
    started: int

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint`` of responses: the start of the engine's cache namespace."""
        return f"kvboost-{self.engine.fingerprint[:16]}"

    def check_model(self, name: str) -> None:
        """Raises a 404 ``model_not_found`` unless ``name`` is one this server serves."""
        if name not in self.model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist on this server; it serves {list(self.model_names)}",
                param="model",
                code="model_not_found",
            )


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request`` (a FastAPI dependency)."""
    state: ServerState = request.app.state.kvboost
    return state


def require_api_key(request: Request) -> None:
    """Checks ``Authorization: Bearer <key>`` when the server has an API key (a FastAPI
    dependency of every ``/v1`` route, behind :class:`~kvboost_rag.server.auth.ApiKeyGate`,
    which refuses such a request before its body is read).

    Raises:
        APIError: 401 ``invalid_api_key`` for a missing or wrong key.
    """
    expected = server_state(request).settings.api_key
    if expected is None:
        return
    if not bearer_key_valid(request.headers.get("authorization", ""), expected):
        raise invalid_api_key()
