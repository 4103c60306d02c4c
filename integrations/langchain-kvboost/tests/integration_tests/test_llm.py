"""KVBoostLLM on the embedded model."""

from __future__ import annotations

import pytest
from langchain_kvboost import ChatKVBoost, KVBoostLLM

PROMPT = "Question: What keyword defines a function in Python?\nAnswer:"


@pytest.mark.slow
def test_default_llm_matches_the_engine_and_streams_the_same_text() -> None:
    llm = KVBoostLLM(max_new_tokens=12)
    assert llm.engine is ChatKVBoost().engine, "objects over the default model share one engine"
    expected = llm.engine.generate(PROMPT, max_new_tokens=12, reuse=False).output_text
    assert llm.invoke(PROMPT) == expected
    assert "".join(llm.stream(PROMPT)) == expected
    assert llm.get_num_tokens(PROMPT) == len(llm.engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])


@pytest.mark.slow
async def test_default_llm_async_batch() -> None:
    llm = KVBoostLLM(max_new_tokens=6)
    prompts = [PROMPT, "Question: What keyword starts a loop over an iterable?\nAnswer:"]
    outputs = await llm.abatch(prompts)
    assert outputs == [llm.engine.generate(p, max_new_tokens=6).output_text for p in prompts]
