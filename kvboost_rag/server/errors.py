"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx or 5xx.

Every client mistake (bad JSON, a field of the wrong type, an unknown model, a prompt longer
than the context window, a schema the constraint compiler refuses) becomes an
:class:`APIError` with a 4xx; the exception handlers :func:`install_handlers` adds turn it,
FastAPI's validation errors, unknown routes and anything unexpected into that shape, so no
request ends without an error object and none takes the server down.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from kvboost_rag import KVBoostError, PromptTooLongError

logger = logging.getLogger(__name__)

#: OpenAI's error ``type`` per status.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server answers with an OpenAI error object.

    Args:
        status: HTTP status.
        message: What went wrong and how to fix it.
        param: The request field at fault, dotted (``messages.0.content``).
        code: A short machine-readable code (``model_not_found``, ``context_length_exceeded``).
        headers: Extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON response carrying it."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def event(self) -> str:
        """The error as a server-sent event (a stream that fails after it started)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def engine_error(exc: KVBoostError, param: str | None = None) -> APIError:
    """The 400 of an error the engine raised on bad input.

    Args:
        exc: The engine's error (its message names the fix).
        param: The request field it concerns, when known.
    """
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param, "context_length_exceeded")
    return bad_request(str(exc), param)


@contextmanager
def client_errors(param: str | None = None) -> Iterator[None]:
    """Turn the engine's input errors raised inside into a 400 naming ``param``."""
    try:
        yield
    except KVBoostError as exc:
        raise engine_error(exc, param) from None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each invalid field, and the first field's dotted path."""
    problems: list[str] = []
    params: list[str] = []
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part != "body"]
        path = ".".join(location)
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", error.get("msg"))
            return f"the request body is not valid JSON: {detail}", None
        params.append(path)
        problems.append(f"{path or 'body'}: {error.get('msg')}")
    return "invalid request: " + "; ".join(problems), params[0] if params else None


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return bad_request(message, param).response()


#: The methods a 405's ``Allow`` header may list.
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> str:
    """The ``Allow`` header of a 405: every method some route takes on the request's path (the
    route that refused knows only its own, and ``/v1/documents`` has one route per method)."""
    routes = request.app.router.routes
    allowed = [method for method in _METHODS
               if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]
    return ", ".join(allowed)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    message = f"{request.method} {request.url.path}: {exc.detail}"
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    return APIError(exc.status_code, message, code=code, headers=headers).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def install_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` with an OpenAI error object."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
