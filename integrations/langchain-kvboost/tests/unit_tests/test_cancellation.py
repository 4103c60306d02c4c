"""An async stream or call that is cancelled stops the engine's request where it is: here it
waits for the model (held by the test), and leaves that wait while the model is still held,
its place in the batch given back (no timing: the test holds the model throughout)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from langchain_core.messages import HumanMessage
from langchain_kvboost import ChatKVBoost, KVBoostLLM

#: Bound on every wait: only ends a hung test, never decides one.
HUNG = 60.0


def _wait_for(condition: Any) -> None:
    pause = threading.Event()
    for _ in range(int(HUNG / 0.002)):
        if condition():
            return
        pause.wait(0.002)
    raise AssertionError("condition not reached")


async def _cancel_while_waiting_for_the_model(engine: Any, start: Any) -> None:
    """Start ``start()`` (awaitable), cancel it once the engine's request waits for its turn,
    and check it left that wait and its place before the model is free again."""
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


def test_cancelling_astream_of_the_chat_model_cancels_its_request(engine: Any) -> None:
    chat = ChatKVBoost(engine=engine, max_new_tokens=8)

    async def first_chunk() -> Any:
        async for chunk in chat.astream([HumanMessage("what is a tuple?")]):
            return chunk

    asyncio.run(_cancel_while_waiting_for_the_model(engine, first_chunk))
    assert chat.invoke([HumanMessage("what is a tuple?")]).content is not None  # the engine goes on


def test_cancelling_ainvoke_and_llm_astream_cancels_their_requests(engine: Any) -> None:
    chat, llm = ChatKVBoost(engine=engine, max_new_tokens=8), KVBoostLLM(engine=engine, max_new_tokens=8)

    async def first_piece() -> Any:
        async for piece in llm.astream("The pass statement"):
            return piece

    asyncio.run(_cancel_while_waiting_for_the_model(engine, lambda: chat.ainvoke([HumanMessage("what is a set?")])))
    asyncio.run(_cancel_while_waiting_for_the_model(engine, first_piece))
