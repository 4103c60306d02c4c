"""A cancelled async stream or call of KVBoostLLM stops the engine's request where it is: here
it waits for the model (held by the test), and leaves that wait while the model is still held
(no timing: the test holds the model throughout)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.llms.kvboost import KVBoostLLM

from kvboost_rag import KVBoost

#: Bound on every wait: only ends a hung test, never decides one.
HUNG = 60.0


def _wait_for(condition: Any) -> None:
    pause = threading.Event()
    for _ in range(int(HUNG / 0.002)):
        if condition():
            return
        pause.wait(0.002)
    raise AssertionError("condition not reached")


async def _cancel_while_waiting_for_the_model(engine: KVBoost, start: Any) -> None:
    turns = engine._requests.turns
    with turns.prompt_work():  # another prompt's work holds the model
        task = asyncio.ensure_future(start())
        await asyncio.to_thread(_wait_for, lambda: turns._prompt_waiting == 1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await asyncio.to_thread(_wait_for, lambda: turns._prompt_waiting == 0 and engine._scheduler.admitted == 0)


def test_cancelled_astream_chat_and_achat_cancel_their_requests(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=8)
    messages = [ChatMessage(role=MessageRole.USER, content="What is a tuple?")]

    async def first_delta() -> Any:
        async for response in await llm.astream_chat(messages):
            return response.delta

    asyncio.run(_cancel_while_waiting_for_the_model(tiny_engine, first_delta))
    asyncio.run(_cancel_while_waiting_for_the_model(tiny_engine, lambda: llm.achat(messages)))
    assert llm.chat(messages).message.content is not None  # the engine goes on
