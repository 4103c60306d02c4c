"""``POST /v1/completions``: text prompts completed as they are (no chat template).

One prompt runs as one stream (or streamed as server-sent events); several prompts in one
request run through ``KVBoost.generate_batch``, which prefills each with its own reuse,
computes once a leading part they share, and decodes them together. ``response_format``
constrains the output as in chat (an extension, as in vLLM).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kvboost_rag import GenerationResult, GenerationStream, KVBoost, KVBoostError
from kvboost_rag.server.admission import Slot
from kvboost_rag.server.errors import bad_request, client_errors, engine_error
from kvboost_rag.server.generation import (
    CLIENT_CLOSED,
    check_constraint,
    check_supported,
    engine_params,
    run_to_end,
    start_stream,
    unless_disconnected,
)
from kvboost_rag.server.internals import call_in_thread
from kvboost_rag.server.limits import check_completion_limits
from kvboost_rag.server.prompts import response_format_constraint
from kvboost_rag.server.responses import (
    ResponseMeta,
    completion,
    completion_choice,
    figure_headers,
    finish_reason,
    usage_chunk,
)
from kvboost_rag.server.schemas import CompletionRequest
from kvboost_rag.server.state import ServerState, server_state
from kvboost_rag.server.streaming import EventStreamResponse, pieces, sse

router = APIRouter()


def _prompts(body: CompletionRequest) -> list[str]:
    """The request's text prompts.

    Raises:
        APIError: Token-id prompts, no prompt, or several prompts streamed.
    """
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise bad_request("prompt must be a string or a list of strings (token-id prompts are not taken)", "prompt")
    if body.stream and len(prompts) > 1:
        raise bad_request(f"stream=true takes one prompt, got {len(prompts)}; send one request per prompt", "prompt")
    return prompts  # type: ignore[return-value]


def _check_completion_fields(body: CompletionRequest) -> None:
    check_supported(body)
    if body.echo:
        raise bad_request("echo is not supported; the prompt is yours already", "echo")
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    if body.best_of not in (None, 1):
        raise bad_request("best_of must be 1", "best_of")
    if body.logprobs:
        raise bad_request("logprobs are not returned by this server", "logprobs")


async def completion_events(
    stream: GenerationStream, meta: ResponseMeta, include_usage: bool, constraint: Any = None
) -> AsyncIterator[str]:
    """The events of a streamed completion (``[DONE]`` is added by the response)."""
    kind = "text_completion"
    async with aclosing(pieces(stream)) as items:
        async for piece in items:
            if piece:
                yield sse({**meta.envelope(kind), "choices": [completion_choice(0, piece, None, None)]})
    result = stream.result
    assert result is not None  # the stream ran to its end
    yield sse({**meta.envelope(kind), "choices": [completion_choice(0, "", finish_reason(result, constraint), result)]})
    if include_usage:
        yield sse(usage_chunk(meta, kind, result))


async def _batch(
    engine: KVBoost, prompts: list[str], params: dict[str, Any], request: Request
) -> list[GenerationResult] | None:
    """``generate_batch`` in a worker thread; a prompt the engine refuses fails the request.

    Returns:
        The results, or ``None`` when the client disconnected first (the call is cancelled).

    Raises:
        APIError: A 400 naming the first refused prompt.
    """

    def run() -> list[GenerationResult | Exception]:
        check_constraint(engine, params, "response_format")
        with client_errors("prompt"):
            return engine.generate_batch(prompts, **params)

    finished, outputs = await unless_disconnected(call_in_thread(run), request)
    if not finished or outputs is None:
        return None
    for i, output in enumerate(outputs):
        if isinstance(output, KVBoostError):
            raise engine_error(output, f"prompt.{i}")
        if isinstance(output, Exception):
            raise output
    return outputs  # type: ignore[return-value]


async def _answer(state: ServerState, body: CompletionRequest, request: Request, slot: Slot) -> tuple[Response, bool]:
    """The response, and whether it took over ``slot`` (a stream releases it when it ends)."""
    prompts = _prompts(body)
    params = engine_params(body, state.settings, body.max_tokens)
    constraint = response_format_constraint(body.response_format)
    if constraint is not None:
        params["constraint"] = constraint
    meta = ResponseMeta.new("cmpl", body.model, state.fingerprint)
    if len(prompts) > 1:
        results = await _batch(state.engine, prompts, params, request)
        if results is None:
            return Response(status_code=CLIENT_CLOSED), False
        return JSONResponse(completion(meta, results, constraint)), False
    stream = await start_stream(state.engine, partial(str, prompts[0]), params, "prompt")
    if body.stream:
        return EventStreamResponse(completion_events(stream, meta, body.include_usage, constraint), slot.release), True
    result = await run_to_end(stream, request)
    if result is None:
        return Response(status_code=CLIENT_CLOSED), False
    return JSONResponse(completion(meta, [result], constraint), headers=figure_headers(result)), False


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)) -> Response:
    """Complete one or several text prompts (one streamed with ``stream=true``)."""
    state.check_model(body.model)
    check_completion_limits(body, state.settings.limits)
    _check_completion_fields(body)
    return await state.admission.within(partial(_answer, state, body, request))
