"""The app's OpenAPI schema (``/openapi.json``), made to say what the server does.

FastAPI derives a schema from the routes and the request models; this module reshapes it for
one app, from its settings, so that a client or a fuzzer (Schemathesis) reading it sends what
the server accepts and expects what it answers:

* the ``model`` fields list the served names (an ``enum``);
* each operation lists every status it answers, each error with the OpenAI error object
  (FastAPI's 422 is gone: validation errors are 400s here, see :mod:`.errors`);
* request fields carry the bounds the server checks (``max_tokens`` up to
  ``max_tokens_limit``, the seed range, stop strings, tools, documents, prompts per request
  from :class:`~.settings.RequestLimits`) and the values of fields it only takes at their
  default (``n``, the penalties, ``logprobs``, ``echo`` ...);
* ``POST /v1/documents`` describes its bodies: a JSON list of texts or ``{"documents": [...]}``,
  or JSONL (one ``{"id", "text"}`` object per line, described as the array of those lines);
* with an API key, the ``/v1`` operations declare HTTP bearer authentication.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvboost_rag.server.documents import JSONL_TYPES
from kvboost_rag.server.settings import SEED_MAX, SEED_MIN, ServerSettings

logger = logging.getLogger(__name__)

#: The component holding the OpenAI error object.
ERROR_COMPONENT = "Error"

#: What each status means, as the schema's response descriptions say it.
STATUS_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, a field of the wrong type or value, a bound exceeded, an unsupported "
    "field, too long a prompt (`context_length_exceeded`)",
    401: "Missing or wrong API key (`invalid_api_key`)",
    404: "Unknown model (`model_not_found`)",
    413: "Request body over the server's bound (`request_too_large`)",
    429: "The server holds its most requests (`rate_limit_exceeded`); retry after `Retry-After` seconds",
    503: "The server is shutting down; retry after `Retry-After` seconds",
}

#: The error statuses each operation answers besides 401 (with an API key).
OPERATION_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/chat/completions"): (400, 404, 413, 429, 503),
    ("post", "/v1/completions"): (400, 404, 413, 429, 503),
    ("post", "/v1/documents"): (400, 413, 429, 503),
    ("get", "/v1/documents"): (),
    ("get", "/v1/models"): (),
    ("get", "/v1/models/{name}"): (404,),
    ("get", "/health"): (503,),
}

#: Statuses answered with ``Retry-After``.
RETRY_STATUSES = (429, 503)

#: Components FastAPI adds for its own 422, never answered here.
UNUSED_COMPONENTS = ("HTTPValidationError", "ValidationError")

#: Generation fields taken only at their default value: a request giving another gets a 400
#: (:func:`.generation.check_supported`, the endpoints' own checks).
DEFAULT_ONLY: dict[str, dict[str, Any]] = {
    "n": {"type": "integer", "enum": [1]},
    "presence_penalty": {"anyOf": [{"type": "number", "enum": [0]}, {"type": "null"}]},
    "frequency_penalty": {"anyOf": [{"type": "number", "enum": [0]}, {"type": "null"}]},
    "logit_bias": {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]},
}
CHAT_DEFAULT_ONLY: dict[str, dict[str, Any]] = {
    "logprobs": {"anyOf": [{"type": "boolean", "enum": [False]}, {"type": "null"}]},
    "top_logprobs": {"anyOf": [{"type": "integer", "enum": [0]}, {"type": "null"}]},
}
COMPLETION_DEFAULT_ONLY: dict[str, dict[str, Any]] = {
    "echo": {"type": "boolean", "enum": [False], "default": False},
    "suffix": {"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]},
    "best_of": {"anyOf": [{"type": "integer", "enum": [1]}, {"type": "null"}]},
    "logprobs": {"anyOf": [{"type": "integer", "enum": [0]}, {"type": "null"}]},
}

#: A tool definition as the server reads it (its ``parameters``: a JSON object schema).
TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1},
                           "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                           "parameters": {"anyOf": [{"type": "object", "properties": {"type": {"enum": ["object"]}}},
                                                    {"type": "null"}]}},
            "required": ["name"],
        },
    },
    "required": ["function"],
}
#: ``tool_choice``: a mode, or one of the request's tools by name.
TOOL_CHOICE: dict[str, Any] = {"anyOf": [
    {"type": "string", "description": "auto, none, required (any), or the name of one of the tools"},
    {"type": "object", "properties": {"type": {"type": "string", "enum": ["function"]},
                                      "function": {"type": "object", "properties": {"name": {"type": "string"}},
                                                   "required": ["name"]}},
     "required": ["function"]},
    {"type": "null"},
]}
#: ``response_format``: text, any JSON object, or JSON valid for a schema.
RESPONSE_FORMAT: dict[str, Any] = {"anyOf": [
    {"type": "object", "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
     "required": ["type"]},
    {"type": "object", "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                                      "json_schema": {"type": "object", "properties": {
                                          "name": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                          "schema": {"type": "object"}}, "required": ["schema"]}},
     "required": ["type", "json_schema"]},
    {"type": "null"},
]}


def error_schema() -> dict[str, Any]:
    """The OpenAI error object, ``{"error": {"message", "type", "param", "code"}}``."""
    nullable_string = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    detail = {
        "type": "object",
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": nullable_string,
                       "code": nullable_string},
        "required": ["message", "type", "param", "code"],
    }
    return {"type": "object", "properties": {"error": detail}, "required": ["error"],
            "description": "The OpenAI error object."}


def error_response(status: int) -> dict[str, Any]:
    """The response object of an error ``status``."""
    response: dict[str, Any] = {
        "description": STATUS_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_COMPONENT}"}}},
    }
    if status in RETRY_STATUSES:
        response["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds to wait"}}
    return response


def _operations(schema: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            yield path, method, operation


def set_responses(schema: dict[str, Any], settings: ServerSettings) -> None:
    """Each operation's error statuses with the error object; 401 on ``/v1`` with a key."""
    for path, method, operation in _operations(schema):
        responses = operation.setdefault("responses", {})
        responses.pop("422", None)
        statuses = list(OPERATION_ERRORS.get((method, path), ()))
        if settings.api_key is not None and path.startswith("/v1"):
            statuses.append(401)
        for status in sorted(statuses):
            responses[str(status)] = error_response(status)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in UNUSED_COMPONENTS:
        components.pop(name, None)
    components[ERROR_COMPONENT] = error_schema()


def set_security(schema: dict[str, Any], settings: ServerSettings) -> None:
    """With an API key: HTTP bearer authentication on every ``/v1`` operation."""
    if settings.api_key is None:
        return
    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer <api key>`"}
    }
    for path, _method, operation in _operations(schema):
        if path.startswith("/v1"):
            operation["security"] = [{"bearer": []}]


def _component(schema: dict[str, Any], name: str) -> dict[str, Any] | None:
    return schema.get("components", {}).get("schemas", {}).get(name)


def _nullable(value: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [value, {"type": "null"}]}


def _stop_schema(settings: ServerSettings) -> dict[str, Any]:
    """Stop strings: one, or a list, non-empty and within the server's bounds."""
    limits = settings.limits
    one = {"type": "string", "maxLength": limits.max_stop_chars}
    item = {**one, "minLength": 1}  # an empty string in a list is refused; alone, it means none
    return {"anyOf": [one, {"type": "array", "items": item, "maxItems": limits.max_stop_sequences},
                      {"type": "null"}]}


def _generation_fields(settings: ServerSettings, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The shared generation fields as the server checks them."""
    budget: dict[str, Any] = {"type": "integer", "minimum": 1}
    if settings.max_tokens_limit is not None:
        budget["maximum"] = settings.max_tokens_limit
    documents = {"type": "array", "items": {"type": "string"}, "maxItems": settings.limits.max_request_documents}
    return {
        "model": {"type": "string", "enum": list(names), "description": "A served model name (GET /v1/models)"},
        "max_tokens": _nullable(budget),
        "seed": _nullable({"type": "integer", "minimum": SEED_MIN, "maximum": SEED_MAX}),
        "stop": _stop_schema(settings),
        "repetition_penalty": _nullable({"type": "number", "minimum": 1.0}),
        "documents": _nullable(documents),
        **DEFAULT_ONLY,
    }


def _chat_fields(settings: ServerSettings) -> dict[str, dict[str, Any]]:
    budget: dict[str, Any] = {"type": "integer", "minimum": 1}
    if settings.max_tokens_limit is not None:
        budget["maximum"] = settings.max_tokens_limit
    return {"max_completion_tokens": _nullable(budget), **CHAT_DEFAULT_ONLY}


def _completion_fields(settings: ServerSettings) -> dict[str, dict[str, Any]]:
    text = {"type": "string", "minLength": 1}
    prompts = {"type": "array", "items": text, "minItems": 1, "maxItems": settings.limits.max_prompts}
    return {"prompt": {"anyOf": [text, prompts], "description": "A text prompt, or a list of them (token ids are "
                       "not taken; `stream` takes one prompt)"}, **COMPLETION_DEFAULT_ONLY}


def _override(component: dict[str, Any] | None, fields: dict[str, dict[str, Any]]) -> None:
    if component is None:
        return
    properties = component.setdefault("properties", {})
    for name, value in fields.items():
        title = properties.get(name, {}).get("title")
        properties[name] = {**value, **({"title": title} if title else {})}


def set_request_fields(schema: dict[str, Any], settings: ServerSettings, names: tuple[str, ...]) -> None:
    """The generation requests' fields as the server checks them (names, bounds, defaults)."""
    shared = _generation_fields(settings, names)
    _override(_component(schema, "ChatCompletionRequest"), {**shared, **_chat_fields(settings)})
    _override(_component(schema, "CompletionRequest"), {**shared, **_completion_fields(settings)})
    _override(_component(schema, "ContentPart"), {"type": {"type": "string", "enum": ["text"]}})
    tools = {"type": "array", "items": TOOL, "maxItems": settings.limits.max_tools}
    _override(_component(schema, "ChatCompletionRequest"),
              {"tools": _nullable(tools), "tool_choice": TOOL_CHOICE, "response_format": RESPONSE_FORMAT})
    _override(_component(schema, "CompletionRequest"), {"response_format": RESPONSE_FORMAT})


def set_stream_responses(schema: dict[str, Any]) -> None:
    """The generation endpoints answer JSON, or server-sent events with ``stream=true``."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        ok = schema.get("paths", {}).get(path, {}).get("post", {}).get("responses", {}).get("200")
        if ok is not None:
            ok.setdefault("content", {})["text/event-stream"] = {}
            ok["description"] = "The completion (JSON), or its chunks as server-sent events with `stream=true`"


def warm_body_schema(settings: ServerSettings) -> dict[str, Any]:
    """The request body of ``POST /v1/documents``."""
    document = {"type": "object", "properties": {"id": _nullable({"type": "string"}), "text": {"type": "string"}},
                "required": ["text"], "description": "A document with an id for the report"}
    listed = {"type": "array", "items": {"anyOf": [{"type": "string"}, document]},
              "maxItems": settings.limits.max_warm_documents}
    wrapped = {"type": "object", "properties": {"documents": listed}, "required": ["documents"]}
    line = {"type": "object", "properties": {"id": {"description": "Any JSON value, read as text"},
                                             "text": {"type": "string"}}, "required": ["text"]}
    jsonl = {"type": "array", "items": line, "maxItems": settings.limits.max_warm_documents,
             "description": "JSONL: one object per line (described as the array of the lines)"}
    content = {"application/json": {"schema": {"anyOf": [listed, wrapped]}}}
    content.update({kind: {"schema": jsonl} for kind in JSONL_TYPES[:2]})
    return {"required": True, "content": content}


def set_warm_body(schema: dict[str, Any], settings: ServerSettings) -> None:
    """``POST /v1/documents`` reads its body itself: say which bodies it takes."""
    operation = schema.get("paths", {}).get("/v1/documents", {}).get("post")
    if operation is not None:
        operation["requestBody"] = warm_body_schema(settings)


def build_schema(app: FastAPI, settings: ServerSettings, names: tuple[str, ...]) -> dict[str, Any]:
    """The OpenAPI schema of ``app`` as the server answers (see the module's docstring)."""
    schema = copy.deepcopy(get_openapi(title=app.title, version=app.version, summary=app.summary,
                                       description=app.description, routes=app.routes))
    set_responses(schema, settings)
    set_stream_responses(schema)
    set_security(schema, settings)
    set_request_fields(schema, settings, names)
    set_warm_body(schema, settings)
    return schema


def install_schema(app: FastAPI, settings: ServerSettings, names: tuple[str, ...]) -> None:
    """Serve :func:`build_schema` at ``app``'s ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, settings, names)
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # FastAPI's documented way to customise the schema
