"""Each request's inputs held to the server's bounds (:class:`~.settings.RequestLimits`) before
any work: a request over one gets a 400 naming the limit and its value.

The checks run in the route, before admission: a request refused here took no place, no
thread and no token of the model's time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvboost_rag.server.errors import APIError, bad_request
from kvboost_rag.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationFields
from kvboost_rag.server.settings import SEED_MAX, SEED_MIN, RequestLimits


def _too_many(param: str, count: int, limit: int, setting: str, noun: str) -> APIError:
    return bad_request(
        f"{param} has {count} {noun}, more than this server takes ({setting}={limit}); send at most {limit}",
        param,
        "array_above_max_length",
    )


def check_count(param: str, items: Sequence[Any] | dict[str, Any] | None, limit: int, setting: str, noun: str) -> None:
    """Refuse more than ``limit`` items in ``param``.

    Args:
        param: The request field (dotted).
        items: Its value (``None``: none).
        limit: The most it may hold.
        setting: The limit's name in :class:`RequestLimits`, for the message.
        noun: What it holds (``"strings"``, ``"prompts"``).

    Raises:
        APIError: A 400 ``array_above_max_length`` naming the limit.
    """
    if items is not None and len(items) > limit:
        raise _too_many(param, len(items), limit, setting, noun)


def check_stop(stop: str | list[str] | None, limits: RequestLimits) -> None:
    """Bound the stop strings: how many, and how long each is.

    Raises:
        APIError: A 400 naming ``max_stop_sequences`` or ``max_stop_chars``.
    """
    strings = [stop] if isinstance(stop, str) else stop or []
    check_count("stop", strings, limits.max_stop_sequences, "max_stop_sequences", "strings")
    for i, text in enumerate(strings):
        if len(text) > limits.max_stop_chars:
            param = "stop" if isinstance(stop, str) else f"stop.{i}"
            raise bad_request(
                f"{param} has {len(text)} characters, more than this server takes in a stop string "
                f"(max_stop_chars={limits.max_stop_chars})",
                param,
                "string_above_max_length",
            )


def check_seed(seed: int | None) -> None:
    """Refuse a seed outside the signed 64-bit range (torch's generators take it; past it,
    sampling would fail after the prompt's prefill).

    Raises:
        APIError: A 400 naming the range.
    """
    if seed is None:
        return
    if seed > SEED_MAX:
        raise bad_request(f"seed={seed} is above the largest seed ({SEED_MAX}, 2**63-1)", "seed",
                          "integer_above_max_value")
    if seed < SEED_MIN:
        raise bad_request(f"seed={seed} is below the smallest seed ({SEED_MIN}, -2**63)", "seed",
                          "integer_below_min_value")


def check_schema_size(param: str, value: Any, limits: RequestLimits) -> None:
    """Refuse a tool definition or response format whose JSON is over ``max_schema_bytes``.

    Raises:
        APIError: A 400 naming ``max_schema_bytes``.
    """
    if value is None:
        return
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    if size > limits.max_schema_bytes:
        raise bad_request(
            f"{param} takes {size} bytes as JSON, more than this server compiles "
            f"(max_schema_bytes={limits.max_schema_bytes})",
            param,
            "object_above_max_size",
        )


def pinned_documents(messages: Sequence[ChatMessage]) -> int:
    """How many content parts of ``messages`` are marked ``cache_control`` (documents)."""
    return sum(
        1
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
        if part.cache_control is not None
    )


def check_generation_limits(body: GenerationFields, limits: RequestLimits, pinned: int = 0) -> None:
    """The bounds both generation endpoints share: stop, seed, documents, logit_bias and
    ``response_format``.

    Args:
        body: The request.
        limits: The server's bounds.
        pinned: Documents its content parts name (``cache_control``), besides ``documents``.

    Raises:
        APIError: A 400 naming the first limit the request is over.
    """
    check_stop(body.stop, limits)
    check_seed(body.seed)
    documents = len(body.documents or []) + pinned
    if documents > limits.max_request_documents:
        raise _too_many("documents", documents, limits.max_request_documents, "max_request_documents",
                        "documents (the documents field and content parts marked cache_control, together)")
    check_count("logit_bias", body.logit_bias, limits.max_logit_bias_entries, "max_logit_bias_entries", "entries")
    check_schema_size("response_format", body.response_format, limits)


def check_chat_limits(body: ChatCompletionRequest, limits: RequestLimits) -> None:
    """The bounds of a chat request: those of :func:`check_generation_limits`, and tools.

    Raises:
        APIError: A 400 naming the first limit the request is over.
    """
    check_generation_limits(body, limits, pinned_documents(body.messages))
    check_count("tools", body.tools, limits.max_tools, "max_tools", "tools")
    for i, tool in enumerate(body.tools or []):
        check_schema_size(f"tools.{i}", tool, limits)


def check_completion_limits(body: CompletionRequest, limits: RequestLimits) -> None:
    """The bounds of a completion request: those of :func:`check_generation_limits`, and the
    number of prompts.

    Raises:
        APIError: A 400 naming the first limit the request is over.
    """
    check_generation_limits(body, limits)
    if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        check_count("prompt", body.prompt, limits.max_prompts, "max_prompts", "prompts")
