"""KVBoostLLM on a tiny random-weight model."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from unittest import mock

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_kvboost import KVBoostLLM
from pydantic import ValidationError

from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.integration.usage import RESULT_FIGURES as GENERATION_INFO_FIELDS

DOCS = python_reference_documents(max_chars=240)
SYSTEM = "You answer questions about the Python language reference.\n\n"
PROMPT = SYSTEM + "Question: what does the assert statement do?\nAnswer:"


class TokenRecorder(BaseCallbackHandler):
    """Collects the tokens reported through on_llm_new_token."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


@pytest.fixture
def llm(engine: Any) -> KVBoostLLM:
    return KVBoostLLM(engine=engine, max_new_tokens=24)


def test_invoke_equals_full_prefill_of_the_engine(llm: KVBoostLLM, engine: Any) -> None:
    expected = engine.generate(PROMPT, max_new_tokens=24, reuse=False).output_text
    assert llm.invoke(PROMPT) == expected
    # Second call: the prompt's prefix is now cached; an exact prefix hit keeps greedy tokens.
    assert llm.invoke(PROMPT) == expected


def test_generation_info_reports_timing_and_reuse(llm: KVBoostLLM, engine: Any) -> None:
    result = llm.generate([PROMPT])
    info = result.generations[0][0].generation_info
    assert info is not None
    assert set(GENERATION_INFO_FIELDS) <= set(info)
    assert info["ttft_ms"] > 0
    assert info["prompt_tokens"] >= engine.count_tokens(PROMPT)
    assert 0.0 <= info["kv_reuse_ratio"] <= 1.0
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == info["prompt_tokens"]
    assert usage["completion_tokens"] == info["generated_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result.llm_output["model_name"] == engine.model_name


def test_warmed_system_prompt_hits_by_prefix(llm: KVBoostLLM, engine: Any) -> None:
    engine.warm(SYSTEM)
    info = llm.generate([PROMPT]).generations[0][0].generation_info
    assert info["prefix_hit_tokens"] > 0
    assert info["cached_tokens"] >= info["prefix_hit_tokens"]
    assert info["kv_reuse_ratio"] > 0
    baseline = llm.generate([PROMPT], reuse=False).generations[0][0].generation_info
    assert baseline["cached_tokens"] == 0


def test_batch_hands_all_prompts_to_one_generate_call(llm: KVBoostLLM) -> None:
    prompts = [SYSTEM + f"Question: what is a {word}?\nAnswer:" for word in ("list", "tuple", "dict")]
    singles = [llm.invoke(p) for p in prompts]
    with mock.patch.object(KVBoostLLM, "_generate", autospec=True, side_effect=KVBoostLLM._generate) as spy:
        outputs = llm.batch(prompts)
    assert spy.call_count == 1
    assert spy.call_args.args[1] == prompts
    assert outputs == singles


def test_stream_reports_each_piece_to_callbacks(llm: KVBoostLLM) -> None:
    recorder = TokenRecorder()
    pieces = list(llm.stream(PROMPT, config={"callbacks": [recorder]}))
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == llm.invoke(PROMPT)
    assert recorder.tokens == [p for p in pieces if p]


def test_streaming_field_sends_tokens_through_callbacks_on_invoke(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=16, streaming=True)
    recorder = TokenRecorder()
    text = llm.invoke(PROMPT, config={"callbacks": [recorder]})
    assert len(recorder.tokens) > 1
    assert "".join(recorder.tokens) == text


def test_stream_final_chunk_carries_generation_info(llm: KVBoostLLM) -> None:
    chunks = list(llm._stream(PROMPT))
    assert chunks[-1].text == ""
    info = chunks[-1].generation_info
    assert info is not None
    assert info["generated_tokens"] > 0 and info["prompt_tokens"] > 0
    assert "".join(c.text for c in chunks) == llm.invoke(PROMPT)


async def _max_loop_gap_during(awaitable: Any) -> tuple[Any, float, float]:
    """Run ``awaitable`` while a heartbeat ticks; return its result, the largest gap between
    heartbeats and the awaitable's duration (seconds)."""
    beats: list[float] = []
    running = True

    async def heartbeat() -> None:
        while running:
            beats.append(time.perf_counter())
            await asyncio.sleep(0.002)

    beat_task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    started = time.perf_counter()
    result = await awaitable
    duration = time.perf_counter() - started
    running = False
    await beat_task
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    return result, max(gaps), duration


async def test_ainvoke_does_not_block_the_event_loop(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=96)
    expected = await asyncio.to_thread(llm.invoke, PROMPT)
    text, max_gap, duration = await _max_loop_gap_during(llm.ainvoke(PROMPT))
    assert text == expected
    assert duration > 0.05
    assert max_gap < duration / 3


async def test_astream_does_not_block_the_event_loop(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=96)
    expected = await asyncio.to_thread(llm.invoke, PROMPT)
    recorder = TokenRecorder()

    async def collect() -> list[str]:
        return [piece async for piece in llm.astream(PROMPT, config={"callbacks": [recorder]})]

    pieces, max_gap, duration = await _max_loop_gap_during(collect())
    assert "".join(pieces) == expected
    assert recorder.tokens == [p for p in pieces if p]
    assert max_gap < duration / 3


def test_stop_cuts_output_and_ends_decoding(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=48)
    full = llm.generate([PROMPT]).generations[0][0]
    text = full.text
    assert len(text) > 12, "the tiny model should produce enough text to pick a stop string"
    start = next(i for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    stop = text[start : start + 3]
    cut = text[: text.index(stop)]
    stopped = llm.generate([PROMPT], stop=[stop]).generations[0][0]
    assert stopped.text == cut
    assert stopped.generation_info["finish_reason"] == "stop"
    assert stopped.generation_info["generated_tokens"] < full.generation_info["generated_tokens"]
    # A stop list set on the model applies too, and a call-time list replaces it.
    assert KVBoostLLM(engine=engine, max_new_tokens=48, stop=[stop]).invoke(PROMPT) == cut
    assert KVBoostLLM(engine=engine, max_new_tokens=48, stop=[stop]).invoke(PROMPT, stop=["\x00never"]) == text
    assert "".join(llm.stream(PROMPT, stop=[stop])) == cut


def test_per_call_overrides(llm: KVBoostLLM) -> None:
    short = llm.generate([PROMPT], max_new_tokens=3).generations[0][0].generation_info
    assert short["generated_tokens"] <= 3
    alias = llm.generate([PROMPT], max_tokens=3).generations[0][0].generation_info
    assert alias["generated_tokens"] == short["generated_tokens"]
    sampled = [llm.invoke(PROMPT, temperature=1.0, seed=11) for _ in range(2)]
    assert sampled[0] == sampled[1]
    with pytest.raises(ValueError, match="conflict"):
        llm.invoke(PROMPT, max_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="unknown parameter"):
        llm.invoke(PROMPT, max_lenght=3)


def test_init_parameters_are_validated(engine: Any) -> None:
    assert KVBoostLLM(engine=engine, max_tokens=7).max_new_tokens == 7
    assert KVBoostLLM(engine=engine, max_tokens=7, max_new_tokens=7).max_tokens == 7
    with pytest.raises(ValidationError, match="conflict"):
        KVBoostLLM(engine=engine, max_tokens=7, max_new_tokens=8)
    with pytest.raises(ValidationError, match="temperature"):
        KVBoostLLM(engine=engine, temperature=-1.0)
    with pytest.raises(ValidationError, match="not both"):
        KVBoostLLM(engine=engine, model="some/folder")
    with pytest.raises(ValidationError, match="max_new_token"):
        KVBoostLLM(engine=engine, max_new_token=5)
    with pytest.raises(ValidationError, match="kvboost_rag.KVBoost"):
        KVBoostLLM(engine="not an engine")


def test_unknown_model_path_raises_model_not_found(tmp_path: Any) -> None:
    from kvboost_rag import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        KVBoostLLM(model=str(tmp_path / "no-such-model"))


def test_model_folder_loads_once_and_is_shared(tmp_path: Any) -> None:
    from langchain_kvboost import ChatKVBoost

    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    llm = KVBoostLLM(model=str(tmp_path), max_new_tokens=4, engine_settings={"chunk_size": 16})
    chat = ChatKVBoost(model=str(tmp_path), engine_settings={"chunk_size": 16})
    assert llm.engine is chat.engine
    assert KVBoostLLM(model=str(tmp_path), engine_settings={"chunk_size": 32}).engine is not llm.engine
    assert isinstance(llm.invoke(PROMPT), str)


def test_empty_prompt_list_is_an_error(llm: KVBoostLLM) -> None:
    with pytest.raises(ValueError, match="empty list of prompts"):
        llm.generate([])


def test_token_counts_use_the_model_tokenizer(llm: KVBoostLLM, engine: Any) -> None:
    assert llm.get_token_ids(PROMPT) == list(engine.token_ids(PROMPT))
    assert llm.get_num_tokens(PROMPT) == engine.count_tokens(PROMPT)
    assert llm.get_num_tokens(PROMPT) == len(engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])


def _rag_prompt(docs: list[str], question: str) -> str:
    return SYSTEM + "Context:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"


def test_explicit_documents_kwarg_are_cut_and_stored(llm: KVBoostLLM, engine: Any) -> None:
    first, second = DOCS[3], DOCS[7]
    prompt = _rag_prompt([first, second], "what is this?")
    assert engine.cache_stats().documents == 0
    result = llm.generate([prompt], documents=[first, Document(page_content=second)])
    info = result.generations[0][0].generation_info
    assert info["documents_found"] == 2
    assert engine.is_document_warm(first) and engine.is_document_warm(second)
    swapped = llm.generate([_rag_prompt([second, first], "and this?")]).generations[0][0].generation_info
    assert swapped["content_hit_tokens"] > 0


def test_explicit_documents_from_config_metadata(llm: KVBoostLLM, engine: Any) -> None:
    first, second = DOCS[11], DOCS[12]
    # Different leading words each time, so no stored prefix of an earlier prompt covers the
    # documents.
    unmarked = llm.generate(["Plain. " + _rag_prompt([first, second], "what?")])
    assert unmarked.generations[0][0].generation_info["documents_found"] == 0
    marked = llm.generate(["Marked. " + _rag_prompt([first, second], "what?")], metadata={"documents": [first, second]})
    assert marked.generations[0][0].generation_info["documents_found"] == 2
    assert engine.is_document_warm(first) and engine.is_document_warm(second)
    # Documents already known hit by content in a new order; the new one is cut and stored.
    third = DOCS[13]
    configured = llm.generate(
        ["Configured. " + _rag_prompt([third, second, first], "what?")], metadata={"documents": [third]}
    ).generations[0][0].generation_info
    assert configured["documents_found"] == 3
    assert configured["content_hit_tokens"] > 0
    llm.invoke("Invoked. " + _rag_prompt([DOCS[14]], "what?"), config={"metadata": {"documents": [DOCS[14]]}})
    assert engine.is_document_warm(DOCS[14])
    with pytest.raises(TypeError, match="list of strings"):
        llm.invoke("Q: " + first, documents=first)


def test_identifying_and_tracing_params(llm: KVBoostLLM, engine: Any) -> None:
    assert llm._llm_type == "kvboost"
    assert llm._identifying_params["model_name"] == engine.model_name
    assert llm._identifying_params["max_new_tokens"] == 24
    ls = llm._get_ls_params(stop=["\n"])
    assert ls["ls_provider"] == "kvboost"
    assert ls["ls_model_type"] == "llm"
    assert ls["ls_max_tokens"] == 24
    assert ls["ls_stop"] == ["\n"]
