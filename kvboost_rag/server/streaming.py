"""Server-sent events: a stream's text pieces from its worker thread to the client.

Each event is ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]``. An error after the
stream has started is sent as one event holding the OpenAI error object, then ``[DONE]``.
When the client disconnects, the response closes its event iterators; closing them stops the
worker thread after the piece in progress and closes the engine's stream, so the sequence
leaves the decode batch.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvboost_rag import GenerationStream, KVBoostError
from kvboost_rag.server.errors import APIError, engine_error
from kvboost_rag.server.internals import iterate_in_thread
from kvboost_rag.server.responses import json_text

logger = logging.getLogger(__name__)

#: The last event of every stream.
DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json_text(payload)}\n\n"


async def pieces(stream: GenerationStream) -> AsyncIterator[str]:
    """The text pieces of ``stream``, iterated in a worker thread; closing this iterator
    closes the stream."""
    async with aclosing(iterate_in_thread(lambda: stream)) as items:
        async for piece in items:
            yield piece


async def _events_then_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events``, an error event if they fail, then ``[DONE]``."""
    try:
        async with aclosing(events) as items:  # type: ignore[type-var]
            async for event in items:
                yield event
    except APIError as exc:
        yield exc.event()
    except KVBoostError as exc:
        yield engine_error(exc).event()
    except Exception as exc:  # noqa: BLE001 - the response has started: the error goes in the stream
        logger.exception("a stream failed after it started")
        yield APIError(500, f"internal error: {type(exc).__name__}: {exc}").event()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over ``events``.

    Args:
        events: The events (without ``[DONE]``, added here).
        on_close: Runs once the response is over: sent whole, failed, or its client gone.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self._events = _events_then_done(events)
        self._on_close = on_close
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(self._events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()  # type: ignore[attr-defined]
            finally:
                self._on_close()
