"""batch/abatch of KVBoostLLM and ChatKVBoost decode their inputs together."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from unittest import mock

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_kvboost import ChatKVBoost, KVBoostLLM

from kvboost_rag import InvalidInputError

SYSTEM = "You answer questions about the Python language reference.\n\n"
WORDS = ("list", "tuple", "dict", "set", "bytes", "class")
PROMPTS = [SYSTEM + f"Question: what is a {word}?\nAnswer:" for word in WORDS]


def _record_steps(engine: Any) -> list[int]:
    """Sizes of the engine's decode steps from now on."""
    sizes: list[int] = []
    loop = engine._loop
    finish = loop._finish_rows
    loop._finish_rows = lambda rows, outputs: (sizes.append(len(rows.sequences)), finish(rows, outputs))[1]
    return sizes


def _alone(make_engine: Callable[..., Any], prompts: list[str], max_new_tokens: int) -> list[Any]:
    reference = make_engine()
    return [reference.generate(p, max_new_tokens=max_new_tokens, reuse=False) for p in prompts]


def test_llm_batch_decodes_its_prompts_in_one_batch(engine: Any, make_engine: Callable[..., Any]) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=12)
    sizes = _record_steps(engine)
    with mock.patch.object(engine, "generate_batch", wraps=engine.generate_batch) as spy:
        result = llm.generate(PROMPTS)
    assert spy.call_count == 1
    assert sizes[0] == len(PROMPTS), "all prompts join the first decode step"
    alone = _alone(make_engine, PROMPTS, 12)
    for generations, reference in zip(result.generations, alone):
        info = generations[0].generation_info
        assert generations[0].text == reference.output_text
        assert info["prompt_tokens"] == reference.prompt_tokens
        assert info["generated_tokens"] == reference.generated_tokens
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == sum(r.prompt_tokens for r in alone)
    ttfts = [g[0].generation_info["ttft_ms"] for g in result.generations]
    assert ttfts == sorted(ttfts)


def test_llm_abatch_goes_through_one_batch(engine: Any, make_engine: Callable[..., Any]) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=12)
    sizes = _record_steps(engine)
    outputs = asyncio.run(llm.abatch(PROMPTS))
    assert outputs == [r.output_text for r in _alone(make_engine, PROMPTS, 12)]
    assert sizes[0] == len(PROMPTS)


def test_llm_batch_raises_the_failing_prompts_error(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=4)
    outputs = llm.batch([PROMPTS[0], "   "], return_exceptions=True)
    assert all(isinstance(o, InvalidInputError) for o in outputs)
    assert engine._places.admitted == 0


def _conversations() -> list[list[Any]]:
    return [[SystemMessage(SYSTEM), HumanMessage(f"What is a {word}?")] for word in WORDS]


def test_chat_batch_decodes_its_inputs_together(engine: Any, make_engine: Callable[..., Any]) -> None:
    chat = ChatKVBoost(engine=engine, max_new_tokens=12)
    conversations = _conversations()
    prompts = [chat.render_prompt(c) for c in conversations]
    sizes = _record_steps(engine)
    replies = chat.batch(conversations)
    alone = _alone(make_engine, prompts, 12)
    assert [r.content for r in replies] == [a.output_text for a in alone]
    assert [r.usage_metadata["input_tokens"] for r in replies] == [a.prompt_tokens for a in alone]
    assert max(sizes) > 1, "the inputs never shared a decode step"


def test_chat_abatch_decodes_its_inputs_together(engine: Any, make_engine: Callable[..., Any]) -> None:
    chat = ChatKVBoost(engine=engine, max_new_tokens=12)
    conversations = _conversations()
    sizes = _record_steps(engine)
    replies = asyncio.run(chat.abatch(conversations))
    alone = _alone(make_engine, [chat.render_prompt(c) for c in conversations], 12)
    assert [r.content for r in replies] == [a.output_text for a in alone]
    assert max(sizes) > 1


def test_chat_batch_fails_only_the_bad_input(engine: Any, make_engine: Callable[..., Any]) -> None:
    chat = ChatKVBoost(engine=engine, max_new_tokens=8)
    good = _conversations()[:2]
    bad = [HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])]
    replies = chat.batch([good[0], bad, good[1]], return_exceptions=True)
    assert isinstance(replies[1], ValueError) and "text only" in str(replies[1])
    alone = _alone(make_engine, [chat.render_prompt(c) for c in good], 8)
    assert [replies[0].content, replies[2].content] == [a.output_text for a in alone]
