"""The FastAPI application: routes, error handlers, the body bound, the API key.

=========================  =====================================================
``POST /v1/chat/completions``  a conversation (:mod:`.chat`)
``POST /v1/completions``       text prompts (:mod:`.completions`)
``POST /v1/documents``         warm documents at ingest (:mod:`.documents`)
``GET /v1/documents``          documents kept
``GET /v1/models``             the served model names
``GET /health``                200 when serving, 503 while shutting down (no key needed)
=========================  =====================================================
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse

from kvboost_rag import KVBoost, __version__
from kvboost_rag.server import chat, completions, documents
from kvboost_rag.server.admission import Admission
from kvboost_rag.server.auth import OPEN_PATHS, ApiKeyGate
from kvboost_rag.server.body_limit import BodyLimit
from kvboost_rag.server.errors import install_handlers
from kvboost_rag.server.openapi import install_schema
from kvboost_rag.server.settings import ServerSettings
from kvboost_rag.server.state import ServerState, require_api_key, server_state

models = APIRouter()


def _model_card(name: str, state: ServerState, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "kvboost-rag",
            "max_model_len": state.engine.context_window}


@models.get("/v1/models")
async def list_models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The model names this server answers to (OpenAI's model list)."""
    created = state.started
    return {"object": "list", "data": [_model_card(name, state, created) for name in state.model_names]}


@models.get("/v1/models/{name:path}")
async def get_model(name: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """One served model, or a 404 ``model_not_found``."""
    state.check_model(name)
    return _model_card(name, state, state.started)


async def health(state: ServerState = Depends(server_state)) -> JSONResponse:
    """200 while the server takes requests, 503 once it is shutting down."""
    admission = state.admission
    body = {"status": "shutting_down" if admission.closing else "ok", "model": state.model_names[0],
            "requests": admission.active, "max_pending": admission.limit, "version": __version__}
    return JSONResponse(body, status_code=503 if admission.closing else 200)


def create_app(engine: KVBoost, settings: ServerSettings | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``engine``.

    Args:
        engine: The engine every request runs on (shared: concurrent requests decode in one
            batch).
        settings: The server's settings (defaults when omitted).

    Returns:
        A FastAPI app; serve it with uvicorn (``kvboost-rag serve`` does), or call it in
        process (``httpx.ASGITransport``).
    """
    settings = settings or ServerSettings()
    names = settings.model_names or (engine.model_name,)
    admission = Admission(settings.max_pending, settings.retry_after_seconds)
    app = FastAPI(title="kvboost-rag", version=__version__, summary="OpenAI-compatible API with K/V reuse")
    app.state.kvboost = ServerState(engine, settings, admission, tuple(names), int(time.time()))
    install_handlers(app)
    install_schema(app, settings, tuple(names))
    app.add_api_route("/health", health, methods=["GET"])
    for router in (chat.router, completions.router, documents.router, models):
        app.include_router(router, dependencies=[Depends(require_api_key)])
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    docs = {url for url in (app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url) if url}
    # Added last, so outermost: a request without the key is refused before BodyLimit reads its body.
    app.add_middleware(ApiKeyGate, api_key=settings.api_key, open_paths=OPEN_PATHS | docs)
    return app

