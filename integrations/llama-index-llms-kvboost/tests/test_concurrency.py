"""Concurrent and async calls of KVBoostLLM decode together in the engine's batch."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.llms.kvboost import KVBoostLLM

from kvboost_rag import KVBoost

SYSTEM = "You answer questions about the Python language reference in one short sentence."
QUESTIONS = [f"What is a {word}?" for word in ("list", "tuple", "dict", "set", "generator", "class")]


def _messages(question: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.SYSTEM, content=SYSTEM), ChatMessage(role=MessageRole.USER, content=question)]


def _record_steps(engine: KVBoost) -> list[int]:
    sizes: list[int] = []
    loop = engine._loop
    finish = loop._finish_rows
    loop._finish_rows = lambda rows, outputs: (sizes.append(len(rows.sequences)), finish(rows, outputs))[1]
    return sizes


def _sequential(tiny_parts: tuple[Any, Any]) -> list[str]:
    model, tokenizer = tiny_parts
    llm = KVBoostLLM(engine=KVBoost.from_model(model, tokenizer, show_progress=False), max_new_tokens=16)
    return [llm.chat(_messages(q)).message.content for q in QUESTIONS]


def test_concurrent_achat_calls_share_decode_steps(tiny_engine: KVBoost, tiny_parts: tuple[Any, Any]) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=16)
    sizes = _record_steps(tiny_engine)

    async def ask_all() -> list[Any]:
        return await asyncio.gather(*(llm.achat(_messages(q)) for q in QUESTIONS))

    responses = asyncio.run(ask_all())
    assert [r.message.content for r in responses] == _sequential(tiny_parts)
    assert max(sizes) > 1, "concurrent calls never shared a decode step"
    # Usage stays per call.
    assert [r.raw["usage"]["prompt_tokens"] for r in responses] == [
        tiny_engine.count_tokens(llm.messages_to_prompt(_messages(q))) for q in QUESTIONS
    ]


def test_concurrent_async_streams_yield_per_call(tiny_engine: KVBoost, tiny_parts: tuple[Any, Any]) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=16)
    sizes = _record_steps(tiny_engine)

    async def stream(question: str) -> str:
        chunks = [chunk async for chunk in await llm.astream_chat(_messages(question))]
        assert chunks[-1].raw["usage"]["completion_tokens"] > 0
        return "".join(c.delta or "" for c in chunks)

    async def stream_all() -> list[str]:
        return await asyncio.gather(*(stream(q) for q in QUESTIONS))

    assert asyncio.run(stream_all()) == _sequential(tiny_parts)
    assert max(sizes) > 1


def test_threads_share_decode_steps(tiny_engine: KVBoost, tiny_parts: tuple[Any, Any]) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=16)
    sizes = _record_steps(tiny_engine)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: llm.chat(_messages(q)).message.content, QUESTIONS))
    assert answers == _sequential(tiny_parts)
    assert max(sizes) > 1
