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


def test_system_messages_are_warmed_and_hit_by_prefix(chat: ChatKVBoost, engine: Any, make_engine: Any) -> None:
    first = chat.invoke(_conversation("what does assert do?"))
    system_tokens = first.response_metadata["system_prefix_tokens"]
    system_rendering = engine.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False
    )
    assert system_tokens == len(engine.tokenizer(system_rendering)["input_ids"])
    assert first.response_metadata["prefix_hit_tokens"] >= system_tokens  # warmed, then hit
    second = chat.invoke(_conversation("what is a generator?"))
    assert second.response_metadata["prefix_hit_tokens"] >= system_tokens
    cache_read = second.usage_metadata["input_token_details"]["cache_read"]
    assert cache_read == second.response_metadata["cached_tokens"] >= system_tokens
    # Turned off: nothing is warmed, so a first call on a fresh engine hits nothing.
    cold = ChatKVBoost(engine=make_engine(), warm_system_prompt=False, max_new_tokens=4)
    cold_info = cold.invoke(_conversation("what does assert do?")).response_metadata
    assert cold_info["system_prefix_tokens"] == 0
    assert cold_info["prefix_hit_tokens"] == 0


def test_first_call_ttft_includes_warming_a_new_system_prompt(chat: ChatKVBoost) -> None:
    first = chat.invoke(_conversation("what does pass do?")).response_metadata
    # The warm ran inside this call, so its time is part of the time to the first token.
    assert first["system_prefix_tokens"] > 0
    assert first["ttft_ms"] >= first["system_warm_ms"] > 0
    again = chat.invoke(_conversation("what does break do?")).response_metadata
    assert again["system_warm_ms"] == 0
    assert again["prefix_hit_tokens"] >= again["system_prefix_tokens"]


def test_system_prefix_is_not_warmed_when_template_reorders(engine: Any) -> None:
    # A template that renders the system message after the conversation: its rendering alone
    # is no prefix of the full prompt, so warming it would pin K/V that can never hit.
    engine.tokenizer.chat_template = (
        "{% for m in messages if m['role'] != 'system' %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% for m in messages if m['role'] == 'system' %}"
        "<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatKVBoost(engine=engine, max_new_tokens=4)
    reply = chat.invoke(_conversation("what is a list?"))
    assert reply.response_metadata["system_prefix_tokens"] == 0
    assert reply.response_metadata["system_warm_ms"] == 0


def test_usage_metadata_and_response_metadata(chat: ChatKVBoost, engine: Any) -> None:
    messages = _conversation("what is a set?")
    reply = chat.invoke(messages)
    usage = reply.usage_metadata
    assert usage is not None
    prompt_tokens = len(engine.tokenizer(chat.render_prompt(messages))["input_ids"])
    assert usage["input_tokens"] == prompt_tokens
    assert usage["output_tokens"] == reply.response_metadata["generated_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["input_token_details"]["cache_read"] <= usage["input_tokens"]
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
        chat.invoke(messages, tools=[{"name": "x"}])


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
