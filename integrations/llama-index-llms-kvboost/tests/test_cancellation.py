"""A cancelled async stream or call of KVBoostLLM stops the engine's request where it is: here
it waits for the model (held by the test), and leaves that wait while the model is still held
(no timing: the test holds the model throughout)."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.llms.kvboost import KVBoostLLM

from kvboost_rag import KVBoost
from kvboost_rag.dev.threads import cancel_while_waiting_for_the_model

def test_cancelled_astream_chat_and_achat_cancel_their_requests(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=8)
    messages = [ChatMessage(role=MessageRole.USER, content="What is a tuple?")]

    async def first_delta() -> Any:
        async for response in await llm.astream_chat(messages):
            return response.delta

    asyncio.run(cancel_while_waiting_for_the_model(tiny_engine, first_delta))
    asyncio.run(cancel_while_waiting_for_the_model(tiny_engine, lambda: llm.achat(messages)))
    assert llm.chat(messages).message.content is not None  # the engine goes on
