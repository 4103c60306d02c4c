"""An OpenAI-compatible HTTP server over one engine (``pip install 'kvboost-rag[server]'``).

``kvboost-rag serve`` runs it; :func:`create_app` builds the FastAPI app around an engine you
built; :class:`BackgroundServer` serves one from a thread of your process (notebooks, tests).
Endpoints, extension fields and client snippets: ``docs/server.md``.

The names below are imported on first use, so ``kvboost-rag warm --server`` (a client of a
running server) needs neither FastAPI nor uvicorn.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BackgroundServer": "kvboost_rag.server.background",
    "ServerSettings": "kvboost_rag.server.settings",
    "create_app": "kvboost_rag.server.app",
    "serve": "kvboost_rag.server.run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
