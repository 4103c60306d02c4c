"""Serving an engine from a thread of this process, on a loopback port: notebooks, tests, and
the samples of ``docs/server.md``."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

from kvboost_rag import KVBoost
from kvboost_rag.server.run import make_server
from kvboost_rag.server.settings import ServerSettings

#: Seconds :meth:`BackgroundServer.start` waits for the server to listen.
START_TIMEOUT = 30.0


class BackgroundServer:
    """The OpenAI-compatible server of ``engine`` in a daemon thread.

    Example:
        .. code-block:: python

            with BackgroundServer(engine) as server:
                client = openai.OpenAI(base_url=server.url, api_key="unused")

    Args:
        engine: The engine to serve.
        settings: The server's settings.
        host: Interface to bind.
        port: TCP port; 0 picks a free one (see :attr:`port`).
        log_level: uvicorn's log level.
    """

    def __init__(
        self,
        engine: KVBoost,
        settings: ServerSettings | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ) -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = make_server(engine, settings, host, self.port, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="kvboost-server", daemon=True)

    @property
    def url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> BackgroundServer:
        """Start serving; returns once the server listens.

        Raises:
            RuntimeError: It did not start within ``START_TIMEOUT`` seconds.
        """
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start (see the log)")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let held ones finish, and stop (within ``timeout`` s)."""
        self._server.handle_exit(0, None)
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
