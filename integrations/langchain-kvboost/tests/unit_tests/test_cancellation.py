"""An async stream or call that is cancelled stops the engine's request where it is: here it
waits for the model (held by the test), and leaves that wait while the model is still held,
its place in the batch given back (no timing: the test holds the model throughout)."""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.messages import HumanMessage
from langchain_kvboost import ChatKVBoost, KVBoostLLM

from kvboost_rag.dev.threads import cancel_while_waiting_for_the_model

def test_cancelling_astream_of_the_chat_model_cancels_its_request(engine: Any) -> None:
    chat = ChatKVBoost(engine=engine, max_new_tokens=8)

    async def first_chunk() -> Any:
        async for chunk in chat.astream([HumanMessage("what is a tuple?")]):
            return chunk

    asyncio.run(cancel_while_waiting_for_the_model(engine, first_chunk))
    assert chat.invoke([HumanMessage("what is a tuple?")]).content is not None  # the engine goes on


def test_cancelling_ainvoke_and_llm_astream_cancels_their_requests(engine: Any) -> None:
    chat, llm = ChatKVBoost(engine=engine, max_new_tokens=8), KVBoostLLM(engine=engine, max_new_tokens=8)

    async def first_piece() -> Any:
        async for piece in llm.astream("The pass statement"):
            return piece

    asyncio.run(cancel_while_waiting_for_the_model(engine, lambda: chat.ainvoke([HumanMessage("what is a set?")])))
    asyncio.run(cancel_while_waiting_for_the_model(engine, first_piece))
