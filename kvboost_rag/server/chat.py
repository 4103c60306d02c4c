"""``POST /v1/chat/completions``: a conversation rendered with the model's chat template.

Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``) and ``response_format``
(``json_schema``, ``json_object``) constrain decoding as the in-process ``ChatKVBoost`` does
(:func:`kvboost_rag.integration.pop_call_format`): tool calls name a given tool with
schema-valid arguments, structured outputs parse. Streamed, a reply that is a tool call is
held back and sent whole as one ``tool_calls`` delta once decoded
(:class:`~kvboost_rag.integration.ToolCallHoldBack`); text is sent as it decodes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kvboost_rag import GenerationStream
from kvboost_rag.integration import ToolCallHoldBack
from kvboost_rag.server.admission import Slot
from kvboost_rag.server.errors import bad_request
from kvboost_rag.server.generation import (
    CLIENT_CLOSED,
    check_supported,
    engine_params,
    run_to_end,
    start_stream,
)
from kvboost_rag.server.internals import CallFormat
from kvboost_rag.server.limits import check_chat_limits
from kvboost_rag.server.prompts import call_format, chat_dicts, render
from kvboost_rag.server.responses import (
    ResponseMeta,
    chat_chunk,
    chat_completion,
    figure_headers,
    finish_reason,
    tool_calls,
    usage_chunk,
)
from kvboost_rag.server.schemas import ChatCompletionRequest
from kvboost_rag.server.state import ServerState, server_state
from kvboost_rag.server.streaming import EventStreamResponse, pieces, sse

router = APIRouter()


def _max_tokens(body: ChatCompletionRequest) -> int | None:
    """``max_completion_tokens`` or its older name ``max_tokens``.

    Raises:
        APIError: Both given, with different values.
    """
    a, b = body.max_completion_tokens, body.max_tokens
    if a is not None and b is not None and a != b:
        raise bad_request(f"max_completion_tokens={a} and max_tokens={b} conflict; set one", "max_tokens")
    return a if a is not None else b


def _check_chat_fields(body: ChatCompletionRequest) -> None:
    check_supported(body)
    if body.logprobs or body.top_logprobs:
        raise bad_request("logprobs are not returned by this server; send logprobs=false", "logprobs")


async def chat_events(
    stream: GenerationStream, fmt: CallFormat, meta: ResponseMeta, include_usage: bool
) -> AsyncIterator[str]:
    """The events of a streamed chat completion (``[DONE]`` is added by the response)."""
    yield sse(chat_chunk(meta, {"role": "assistant", "content": ""}))
    hold = ToolCallHoldBack(fmt)
    async with aclosing(pieces(stream)) as items:
        async for piece in items:
            shown = hold.feed(piece)
            if shown:
                yield sse(chat_chunk(meta, {"content": shown}))
    result = stream.result
    assert result is not None  # the stream ran to its end
    parsed = hold.finish(result.finish_reason)
    if parsed is not None and parsed.calls:
        yield sse(chat_chunk(meta, {"content": parsed.content or None, "tool_calls": tool_calls(parsed, indexed=True)}))
    elif parsed is not None and parsed.content:
        yield sse(chat_chunk(meta, {"content": parsed.content}))
    yield sse(chat_chunk(meta, {}, finish_reason(result, fmt.constraint, parsed), result))
    if include_usage:
        yield sse(usage_chunk(meta, "chat.completion.chunk", result))


async def _answer(state: ServerState, body: ChatCompletionRequest, request: Request, slot: Slot) -> tuple[Response, bool]:
    """The response, and whether it took over ``slot`` (a stream releases it when it ends)."""
    fmt = call_format(body)
    dicts, pinned = chat_dicts(body.messages)
    params = engine_params(body, state.settings, _max_tokens(body), pinned)
    if fmt.constraint is not None:
        params["constraint"] = fmt.constraint
    format_param = "tools" if fmt.parses_tool_calls else "response_format"
    make_prompt = partial(render, state.engine, dicts, fmt)
    stream = await start_stream(state.engine, make_prompt, params, "messages", format_param)
    meta = ResponseMeta.new("chatcmpl", body.model, state.fingerprint)
    if body.stream:
        return EventStreamResponse(chat_events(stream, fmt, meta, body.include_usage), slot.release), True
    result = await run_to_end(stream, request)
    if result is None:
        return Response(status_code=CLIENT_CLOSED), False
    return JSONResponse(chat_completion(meta, result, fmt), headers=figure_headers(result)), False


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)
) -> Response:
    """Answer a conversation (streamed as server-sent events with ``stream=true``)."""
    state.check_model(body.model)
    check_chat_limits(body, state.settings.limits)
    _check_chat_fields(body)
    return await state.admission.within(partial(_answer, state, body, request))
