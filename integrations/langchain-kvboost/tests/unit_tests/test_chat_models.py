"""ChatKVBoost on a tiny random-weight model."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
)
from langchain_kvboost import ChatKVBoost

SYSTEM = "You answer questions about the Python language reference, briefly and exactly."


@pytest.fixture
def chat(engine: Any) -> ChatKVBoost:
    return ChatKVBoost(engine=engine, max_new_tokens=16)


def _conversation(question: str) -> list[Any]:
    return [SystemMessage(SYSTEM), HumanMessage(question)]


def test_prompt_is_the_models_chat_template(chat: ChatKVBoost, engine: Any) -> None:
    messages = [SystemMessage(SYSTEM), HumanMessage("hi"), AIMessage("hello"), HumanMessage("what is a tuple?")]
    expected = engine.apply_chat_template(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "what is a tuple?"},
        ],
        add_generation_prompt=True,
    )
    assert chat.render_prompt(messages) == expected
    reply = chat.invoke(messages)
    assert reply.content == engine.generate(expected, max_new_tokens=16, reuse=False).output_text


def test_system_messages_hit_by_prefix_after_the_first_answer(chat: ChatKVBoost, engine: Any) -> None:
    first = chat.invoke(_conversation("what does assert do?")).response_metadata
    system_tokens = engine.count_tokens(
        engine.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    )
    # Nothing was loaded on a fresh engine, so nothing is counted as read from cache.
    assert first["prefix_hit_tokens"] == first["cached_tokens"] == 0
    second = chat.invoke(_conversation("what is a generator?"))
    assert second.response_metadata["prefix_hit_tokens"] >= system_tokens
    cache_read = second.usage_metadata["input_token_details"]["cache_read"]
    assert cache_read == second.response_metadata["cached_tokens"] >= system_tokens


def test_calls_warm_and_pin_nothing(chat: ChatKVBoost, engine: Any) -> None:
    # Pinning is for what users warm explicitly; a call only generates (the engine's own
    # write-back stores the leading part, evictable).
    calls: list[str] = []
    store = engine._cache._store
    real_warm, real_pin = engine.warm, store.pin
    engine.warm = lambda text: calls.append(f"warm {text}") or real_warm(text)
    store.pin = lambda key: calls.append(f"pin {key}") or real_pin(key)
    try:
        chat.invoke(_conversation("what does pass do?"))
        list(chat.stream(_conversation("what does break do?")))
    finally:
        del engine.warm, store.pin
    assert calls == []


def test_usage_metadata_and_response_metadata(chat: ChatKVBoost, engine: Any) -> None:
    messages = _conversation("what is a set?")
    reply = chat.invoke(messages)
    usage = reply.usage_metadata
    assert usage is not None
    prompt_tokens = len(engine.tokenizer(chat.render_prompt(messages))["input_ids"])
    assert usage["input_tokens"] == prompt_tokens
    assert usage["output_tokens"] == reply.response_metadata["generated_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 <= usage["input_token_details"]["cache_read"] <= usage["input_tokens"]
    assert reply.response_metadata["model_name"] == engine.model_name
    assert reply.response_metadata["finish_reason"] in {"stop", "eos", "length"}


def test_stream_matches_invoke_and_ends_with_usage(chat: ChatKVBoost) -> None:
    messages = _conversation("what is a dict?")
    expected = chat.invoke(messages).content
    chunks = list(chat.stream(messages))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert len([c for c in chunks if c.content]) > 1
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.content == expected
    assert chunks[-1].chunk_position == "last"
    assert full.usage_metadata is not None and full.usage_metadata["output_tokens"] > 0
    assert full.response_metadata["model_name"] == chat.model_name


async def test_astream_and_ainvoke_match_invoke(chat: ChatKVBoost) -> None:
    messages = _conversation("what is a frozenset?")
    expected = chat.invoke(messages).content
    assert (await chat.ainvoke(messages)).content == expected
    pieces = [chunk.content async for chunk in chat.astream(messages)]
    assert "".join(pieces) == expected


def test_stop_and_per_call_overrides(chat: ChatKVBoost) -> None:
    messages = _conversation("what is a module?")
    text = chat.invoke(messages, max_new_tokens=32).content
    assert len(text) > 8
    start = next(i for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    stop = text[start : start + 2]
    assert chat.invoke(messages, max_new_tokens=32, stop=[stop]).content == text[: text.index(stop)]
    short = chat.invoke(messages, max_tokens=2)
    assert short.usage_metadata["output_tokens"] <= 2
    with pytest.raises(ValueError, match="conflict"):
        chat.invoke(messages, max_tokens=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="unknown parameter"):
        chat.invoke(messages, frequency_penalty=0.5)


def test_non_text_content_is_rejected(chat: ChatKVBoost) -> None:
    image = HumanMessage(
        content=[{"type": "text", "text": "what is this?"}, {"type": "image", "url": "http://x/y.png"}]
    )
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([image])


def test_text_blocks_and_message_names_are_accepted(chat: ChatKVBoost) -> None:
    blocks = HumanMessage(
        content=[{"type": "text", "text": "what is "}, {"type": "text", "text": "a tuple?"}], name="user1"
    )
    assert chat.render_prompt([blocks]) == chat.render_prompt([HumanMessage("what is a tuple?")])


def test_token_counting_uses_the_chat_template(chat: ChatKVBoost, engine: Any) -> None:
    messages = _conversation("what is a class?")
    assert chat.get_num_tokens_from_messages(messages) == engine.count_tokens(chat.render_prompt(messages))
    assert chat.get_token_ids("def f(): pass") == list(engine.token_ids("def f(): pass"))


def test_tracing_params(chat: ChatKVBoost, engine: Any) -> None:
    ls = chat._get_ls_params(stop=["x"], temperature=0.5)
    assert ls["ls_provider"] == "kvboost"
    assert ls["ls_model_name"] == engine.model_name
    assert ls["ls_model_type"] == "chat"
    assert ls["ls_temperature"] == 0.5
    assert ls["ls_max_tokens"] == 16
    assert ls["ls_stop"] == ["x"]


def test_streaming_field_streams_invoke_through_callbacks(engine: Any) -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    chat = ChatKVBoost(engine=engine, max_new_tokens=12, streaming=True)
    recorder = Tokens()
    reply = chat.invoke(_conversation("what is a tuple?"), config={"callbacks": [recorder]})
    assert len([t for t in recorder.tokens if t]) > 1
    assert "".join(recorder.tokens) == reply.content
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] > 0
