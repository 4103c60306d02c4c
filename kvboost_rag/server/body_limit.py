"""A bound on request bodies: a larger one gets a 413 before the app sees it."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost_rag.server.errors import APIError


class BodyLimit:
    """ASGI middleware answering request bodies over ``limit`` bytes with a 413.

    A declared ``Content-Length`` over the limit is refused before the body is read; a body
    sent without one is read up to the limit and refused once it passes it. A body within
    the limit reaches the app whole, in one message.

    Args:
        app: The wrapped application.
        limit: Largest body in bytes.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body has {size} bytes, more than this server takes ({self.limit}); "
                        "send fewer or shorter texts per request", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._too_large(declared.decode()).response()(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limit:
                await self._too_large(f"over {size}").response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}

        await self.app(scope, replay, send)
