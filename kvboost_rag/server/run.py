"""Running the app under uvicorn: ``kvboost-rag serve`` and :func:`serve`.

On SIGINT/SIGTERM the server first refuses new requests (503 with ``Retry-After``, and
``/health`` turns 503 so a load balancer stops sending), then stops listening and lets the
requests it holds finish (up to :data:`GRACEFUL_SECONDS`), and the cache writes they queued
reach the tiers (up to as long again).
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

import uvicorn

from kvboost_rag import KVBoost
from kvboost_rag.server.admission import Admission
from kvboost_rag.server.app import create_app
from kvboost_rag.server.settings import ServerSettings

logger = logging.getLogger(__name__)

#: Seconds held requests get to finish once the server is told to stop.
GRACEFUL_SECONDS = 30


class KVBoostServer(uvicorn.Server):
    """uvicorn's server, refusing new requests as soon as it is told to stop.

    Args:
        config: uvicorn's config.
        admission: The app's admission, closed on the stop signal.
    """

    def __init__(self, config: uvicorn.Config, admission: Admission) -> None:
        super().__init__(config)
        self.admission = admission

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Close admission (503 from now on), then stop as uvicorn does."""
        self.admission.close()
        super().handle_exit(sig, frame)


def make_server(
    engine: KVBoost, settings: ServerSettings | None, host: str, port: int, log_level: str
) -> KVBoostServer:
    """A uvicorn server of an app serving ``engine`` (not started); its connection bound and
    keep-alive come from the server's settings (``max_connections``, ``keep_alive_seconds``)."""
    settings = settings or ServerSettings()
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
        limit_concurrency=settings.max_connections,
        timeout_keep_alive=settings.keep_alive_seconds,
    )
    return KVBoostServer(config, app.state.kvboost.admission)


def serve(
    engine: KVBoost,
    settings: ServerSettings | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serve ``engine`` until SIGINT/SIGTERM (blocks).

    Args:
        engine: The engine.
        settings: The server's settings.
        host: Interface to bind (loopback unless told otherwise: ``0.0.0.0`` serves every
            interface; set an API key then).
        port: TCP port.
        log_level: uvicorn's log level.
    """
    if host not in ("127.0.0.1", "localhost", "::1") and not (settings and settings.api_key):
        logger.warning("serving on %s without an API key: anyone who reaches this port can use the model", host)
    make_server(engine, settings, host, port, log_level).run()
    if not engine.flush(timeout=GRACEFUL_SECONDS):  # what the last requests stored reaches the tiers
        logger.warning("cache writes were still queued %d s after the server stopped", GRACEFUL_SECONDS)


def serve_command(args: Any, engine_settings: dict[str, Any]) -> int:
    """``kvboost-rag serve``: check the server's settings, build the engine, serve it."""
    from pydantic import ValidationError

    from kvboost_rag.server.internals import EngineSpec

    names = tuple(args.served_model_name or ())
    try:
        settings = ServerSettings(model_names=names, api_key=args.api_key, max_pending=args.max_pending,
                                  max_new_tokens=args.max_tokens, temperature=args.temperature)
    except ValidationError as exc:
        raise SystemExit(f"kvboost-rag serve: {exc}") from None
    spec = EngineSpec(model=args.model, settings=engine_settings, factory=args.engine_factory, threads=args.threads)
    engine = spec.build()
    logger.info("serving %s on http://%s:%d/v1", list(names) or engine.model_name, args.host, args.port)
    serve(engine, settings, args.host, args.port, args.log_level)
    return 0
