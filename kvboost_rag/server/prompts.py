"""Chat requests to prompts: messages to the chat template's dicts, tools and formats to the
call's constraint, and the rendering itself (the one the in-process ``ChatKVBoost`` uses).

Content parts marked ``cache_control`` are documents of the prompt (see
:mod:`kvboost_rag.server.documents`); text parts are joined with a newline, as vLLM joins
them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from kvboost_rag import KVBoost
from kvboost_rag.integration import pop_call_format
from kvboost_rag.server.errors import bad_request, client_errors
from kvboost_rag.server.internals import CallFormat, render_chat
from kvboost_rag.server.schemas import ChatCompletionRequest, ChatMessage, ContentPart

#: Roles under another name in the chat templates.
_ROLE_NAMES = {"developer": "system", "function": "tool"}

#: What joins a message's text parts.
PART_SEPARATOR = "\n"


def _parts_text(parts: Sequence[ContentPart], where: str, pinned: list[str]) -> str:
    """The text of content parts; the text of each ``cache_control`` part goes to ``pinned``."""
    texts: list[str] = []
    for j, part in enumerate(parts):
        if part.type != "text":
            raise bad_request(
                f"{where}.{j} is a {part.type!r} part; this server reads text parts only "
                "({'type': 'text', 'text': ...})",
                f"{where}.{j}.type",
            )
        if part.text is None:
            raise bad_request(f"{where}.{j} is a text part without 'text'", f"{where}.{j}.text")
        texts.append(part.text)
        if part.cache_control is not None and part.text:
            pinned.append(part.text)
    return PART_SEPARATOR.join(texts)


def _arguments(value: str | dict[str, Any]) -> dict[str, Any] | str:
    """Tool-call arguments as the templates read them: an object (JSON text parsed)."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value or "{}")
    except json.JSONDecodeError:
        return value
    return parsed if isinstance(parsed, dict) else value


def _message_dict(message: ChatMessage, where: str, pinned: list[str]) -> dict[str, Any]:
    content = message.content
    text = _parts_text(content, f"{where}.content", pinned) if isinstance(content, list) else content or ""
    entry: dict[str, Any] = {"role": _ROLE_NAMES.get(message.role, message.role), "content": text}
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        entry["name"] = message.name
    return entry


def chat_dicts(messages: Sequence[ChatMessage]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as chat-template dicts (the OpenAI layout: ``tool_calls`` with argument
    objects, ``tool_call_id``), and the texts of their ``cache_control`` parts.

    Raises:
        APIError: A content part that is not text.
    """
    pinned: list[str] = []
    dicts = [_message_dict(m, f"messages.{i}", pinned) for i, m in enumerate(messages)]
    return dicts, pinned


def call_format(body: ChatCompletionRequest) -> CallFormat:
    """The tools, tool choice and response format of a chat request.

    ``parallel_tool_calls`` defaults to true, as in the OpenAI API. A ``tool_choice`` of
    ``"auto"`` or ``"none"`` without tools, and a ``{"type": "text"}`` response format, mean
    plain text.

    Raises:
        APIError: Malformed tools, a ``tool_choice`` naming no tool, an unknown response format.
    """
    choice = body.tool_choice
    if not body.tools and choice in ("auto", "none"):
        choice = None
    response_format = body.response_format
    if response_format is not None and response_format.get("type") == "text":
        response_format = None
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    keywords = {"tools": body.tools, "tool_choice": choice, "response_format": response_format}
    param = "response_format" if response_format is not None else "tools"
    with client_errors(param):
        return pop_call_format({**keywords, "parallel_tool_calls": parallel if body.tools else None})


def response_format_constraint(response_format: dict[str, Any] | None) -> Any:
    """The decoding constraint of a completion request's ``response_format`` (``None``: free
    text).

    Raises:
        APIError: An unknown response format.
    """
    if response_format is None or response_format.get("type") == "text":
        return None
    with client_errors("response_format"):
        return pop_call_format({"response_format": response_format}).constraint


def render(engine: KVBoost, dicts: list[dict[str, Any]], fmt: CallFormat) -> str:
    """The prompt the model reads: the chat template over ``dicts`` with the call's tools and
    format instructions (blocking: run it off the event loop).

    Raises:
        APIError: The model has no chat template, or its template refuses the messages.
    """
    with client_errors("messages"):
        try:
            return render_chat(engine, dicts, fmt)
        except TemplateError as exc:
            raise bad_request(f"the model's chat template refused these messages: {exc}", "messages") from None
