"""One request's generation: its engine parameters, its stream started off the event loop,
and, for an answer sent whole, the stream run to its end while the client is watched.

Every engine call runs on a thread of the async bridges' pool, so concurrent requests reach
the engine together and decode in one batch (the engine loop); the event loop only awaits. A
client that disconnects before its answer is complete cancels its engine call
(:func:`unless_disconnected`; a stream's response is cancelled by Starlette): the request
leaves the queue, its prefill stops at the engine loop's next step, its sequence leaves the
batch at the next step, and its place and buffers go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from kvboost_rag import GenerationResult, GenerationStream, KVBoost
from kvboost_rag.integration import call_params
from kvboost_rag.server.errors import bad_request, client_errors
from kvboost_rag.server.internals import call_in_thread, iterate_in_thread
from kvboost_rag.server.schemas import GenerationFields
from kvboost_rag.server.settings import ServerSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Sampling controls of the OpenAI API this server does not implement, and what to use.
_PENALTIES = ("presence_penalty", "frequency_penalty")

#: Status of the answer to a client that left before it was ready (never sent).
CLIENT_CLOSED = 499


def check_supported(body: GenerationFields) -> None:
    """Refuse the OpenAI fields whose effect this server cannot give (400 naming them); log
    the fields it does not know (ignored).

    Raises:
        APIError: ``n`` above 1, a presence or frequency penalty, a ``logit_bias``.
    """
    ignored = body.ignored_fields()
    if ignored:
        logger.debug("ignored unknown request fields %s", ignored)
    if body.n != 1:
        raise bad_request(f"n={body.n}: this server returns one choice per prompt; send n=1 (or several requests)", "n")
    for name in _PENALTIES:
        value = getattr(body, name)
        if value is not None and value != 0:
            raise bad_request(
                f"{name}={value} is not supported; use repetition_penalty (above 1 lowers the logits of tokens "
                "the answer already holds)",
                name,
            )
    if body.logit_bias:
        raise bad_request("logit_bias is not supported; use response_format or tools to constrain the output",
                          "logit_bias")


def check_max_tokens(max_tokens: int | None, limit: int | None) -> None:
    """Refuse a token budget over the server's ``max_tokens_limit``.

    Raises:
        APIError: A 400 ``integer_above_max_value`` naming ``max_tokens``.
    """
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise bad_request(f"max_tokens={max_tokens} is above this server's limit ({limit}); ask for at most {limit}",
                          "max_tokens", "integer_above_max_value")


def engine_params(
    body: GenerationFields,
    settings: ServerSettings,
    max_tokens: int | None,
    pinned: list[str] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``KVBoost.stream`` for a request.

    Args:
        body: The request.
        settings: The server's settings (the defaults of what the request leaves out).
        max_tokens: The request's token budget (``None``: the server's default).
        pinned: Documents named by the request's content parts (``cache_control``), after
            those of its ``documents`` field.
    """
    check_max_tokens(max_tokens, settings.max_tokens_limit)
    documents = [*(body.documents or []), *(pinned or [])]
    overrides = {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop,
        "seed": body.seed,
        "repetition_penalty": body.repetition_penalty,
        "reuse": body.reuse,
        "documents": documents or None,
    }
    with client_errors():
        return call_params(settings, overrides, owner="the request")


def check_constraint(engine: KVBoost, params: dict[str, Any], param: str) -> None:
    """Compile the call's constraint once before the prompt's work: a schema or grammar the
    compiler refuses, or a budget below its shortest valid output, is a 400 naming ``param``
    or ``max_tokens`` (the compiler keeps its tokenizer view: about a millisecond)."""
    constraint = params.get("constraint")
    if constraint is None:
        return
    with client_errors(param):
        minimum = engine.min_new_tokens(constraint)
    budget = params["max_new_tokens"]
    if minimum is not None and budget < minimum:
        what = "tool call" if param == "tools" else "response format"
        raise bad_request(
            f"max_tokens={budget} is below the {minimum} tokens the shortest {what} takes; raise max_tokens to "
            f"at least {minimum}",
            "max_tokens",
        )


async def start_stream(
    engine: KVBoost,
    make_prompt: Callable[[], str],
    params: dict[str, Any],
    param: str,
    constraint_param: str = "response_format",
) -> GenerationStream:
    """Check the call's constraint, build the prompt and start its stream, in a worker
    thread; the engine checks the input here, before any prefill.

    Args:
        engine: The engine.
        make_prompt: Builds the prompt text (a chat template renders in the thread too).
        params: ``KVBoost.stream`` keyword arguments.
        param: The request field an input error names (``messages``, ``prompt``).
        constraint_param: The request field a constraint error names (``tools``,
            ``response_format``).

    Raises:
        APIError: A 400 for input the engine refuses (too long a prompt, a bad schema, ...).
    """

    def begin() -> GenerationStream:
        check_constraint(engine, params, constraint_param)
        prompt = make_prompt()
        with client_errors(param):
            return engine.stream(prompt, **params)

    return await call_in_thread(begin)


async def _disconnected(request: Request) -> None:
    """Returns once the client of ``request`` is gone (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], request: Request) -> tuple[bool, T | None]:
    """Await ``work`` unless the client of ``request`` leaves first; then cancel it (an engine
    call run through :mod:`kvboost_rag.integration.async_stream` stops where it is).

    Returns:
        ``(True, its result)``, or ``(False, None)`` when the client left first.

    Raises:
        Exception: What ``work`` raised.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or this request was cancelled): stop the work
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


async def run_to_end(stream: GenerationStream, request: Request) -> GenerationResult | None:
    """Run ``stream`` to its end in a worker thread.

    Returns:
        Its result, or ``None`` when the client disconnected first (the stream is cancelled:
        it stops waiting, prefilling or decoding, and its place and buffers go back).

    Raises:
        APIError: A 400 when the engine refuses the input while decoding.
    """

    async def drain() -> None:
        async for _ in iterate_in_thread(lambda: stream):
            pass

    with client_errors():
        finished, _ = await unless_disconnected(drain(), request)
    return stream.result if finished else None
