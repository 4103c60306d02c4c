"""KVBoostLLM on a tiny random-weight Llama: metadata, prompts, reuse, usage, streaming, async."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.kvboost import KVBoostLLM

from kvboost_rag import KVBoost, ModelNotFoundError, PromptTooLongError
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

SYSTEM = "You answer questions about the Python language reference in one short sentence."


def _messages(question: str) -> list[ChatMessage]:
    return [
        ChatMessage(role=MessageRole.SYSTEM, content=SYSTEM),
        ChatMessage(role=MessageRole.USER, content=question),
    ]


def test_metadata_reports_the_model_window_output_name_and_chat_mode(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=12)
    meta = llm.metadata
    assert meta.context_window == tiny_engine.context_window == 4096
    assert meta.num_output == 12
    assert meta.model_name == tiny_engine.model_name
    assert meta.is_chat_model is True  # the tiny tokenizer has a chat template
    assert meta.is_function_calling_model is True


def test_repr_and_serialization_do_not_recurse(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=5)
    assert "KVBoostLLM" in repr(llm) and "chat template" in repr(llm)
    data = llm.to_dict()
    assert data["class_name"] == "KVBoostLLM" and data["max_new_tokens"] == 5
    assert data["context_window"] == tiny_engine.context_window


def test_model_without_chat_template_is_a_completion_model(tiny_parts) -> None:
    model, _ = tiny_parts
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    llm = KVBoostLLM(engine=KVBoost.from_model(model, tokenizer, show_progress=False))
    assert llm.metadata.is_chat_model is False
    # Chat still works, through LlamaIndex's generic "role: content" rendering.
    prompt = llm.messages_to_prompt(_messages("What is a list?"))
    assert prompt.startswith(f"system: {SYSTEM}\nuser: What is a list?")


def test_context_window_can_be_lowered_but_not_raised(tiny_engine: KVBoost) -> None:
    assert KVBoostLLM(engine=tiny_engine, context_window=1024).metadata.context_window == 1024
    with pytest.raises(ValueError, match="exceeds the model's maximum of 4096"):
        KVBoostLLM(engine=tiny_engine, context_window=5000)
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        KVBoostLLM(engine=tiny_engine, context_window=256, max_new_tokens=256)


def test_conflicting_sources_are_rejected(tiny_engine: KVBoost, tiny_parts) -> None:
    model, tokenizer = tiny_parts
    with pytest.raises(ValueError, match="only one of"):
        KVBoostLLM(engine=tiny_engine, model_path="/somewhere")
    with pytest.raises(ValueError, match="go together"):
        KVBoostLLM(model=model)
    with pytest.raises(ValueError, match="engine_settings"):
        KVBoostLLM(engine=tiny_engine, engine_settings={"recompute_ratio": 0.2})


def test_built_from_model_and_tokenizer_with_engine_settings(tiny_parts) -> None:
    model, tokenizer = tiny_parts
    llm = KVBoostLLM(model=model, tokenizer=tokenizer, engine_settings={"recompute_ratio": 0.3, "show_progress": False})
    assert llm.engine.settings.recompute_ratio == 0.3
    assert llm.engine.model is model


def test_unknown_model_path_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="missing-model"):
        KVBoostLLM(model_path=str(tmp_path / "missing-model"))
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError):
        KVBoostLLM(model_path=str(empty))


def test_second_chat_hits_the_system_turn_by_prefix_hash(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4)
    system_turn = tiny_engine.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    first = llm.chat(_messages("What does the with statement do?"))
    second = llm.chat(_messages("How are exceptions raised?"))
    assert first.raw["prefix_hit_tokens"] == 0  # a fresh engine: nothing loaded, nothing counted
    assert second.raw["prefix_hit_tokens"] >= tiny_engine.count_tokens(system_turn)
    assert second.raw["kv_reuse_ratio"] == pytest.approx(second.raw["cached_tokens"] / second.raw["prompt_tokens"])


def test_chat_output_equals_full_prefill_of_the_same_prompt(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=12)
    messages = _messages("What is a generator?")
    llm.chat(messages)  # warm
    reused = llm.chat(messages)
    assert reused.raw["prefix_hit_tokens"] > 0
    prompt = llm.messages_to_prompt(messages)
    full = tiny_engine.generate(prompt, max_new_tokens=12, reuse=False)
    assert reused.message.content == full.output_text
    assert reused.raw["usage"]["prompt_tokens"] == full.prompt_tokens


def test_complete_wraps_the_prompt_as_a_user_turn_with_the_system_prompt(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4, system_prompt=SYSTEM)
    assert llm.completion_to_prompt("Hi") == llm.messages_to_prompt(_messages("Hi"))
    llm.complete("What is a list?")
    second = llm.complete("What is a dict?")
    system_turn = tiny_engine.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert second.raw["prefix_hit_tokens"] >= tiny_engine.count_tokens(system_turn)
    raw_prompt = llm.complete("plain text", formatted=True)
    assert raw_prompt.raw["usage"]["prompt_tokens"] == tiny_engine.count_tokens("plain text")


def test_completion_model_reuses_the_system_prompt_of_predict(tiny_parts) -> None:
    model, _ = tiny_parts
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    engine = KVBoost.from_model(model, tokenizer, show_progress=False)
    llm = KVBoostLLM(engine=engine, max_new_tokens=4, system_prompt=SYSTEM)
    template = PromptTemplate("Question: {question}\nAnswer:")
    handler = TokenCountingHandler(tokenizer=llm.model_tokenizer_fn)
    llm.callback_manager = CallbackManager([handler])
    llm.predict(template, question="What is a list?")
    llm.predict(template, question="What is a set?")
    second = handler.llm_token_counts[-1]
    assert second.prompt.startswith(SYSTEM + "\n\n")
    assert engine.cache_stats().counters["prefix_hit_tokens"] >= engine.count_tokens(SYSTEM)


def test_raw_usage_is_what_token_counting_handler_counts(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=6)
    counter = TokenCountingHandler(tokenizer=llm.model_tokenizer_fn)
    llm.callback_manager = CallbackManager([counter])
    response = llm.chat(_messages("What is a closure?"))
    usage = response.raw["usage"]
    prompt = llm.messages_to_prompt(_messages("What is a closure?"))
    assert usage["prompt_tokens"] == len(tiny_engine.tokenizer(prompt)["input_ids"])
    assert usage["completion_tokens"] == response.raw["generated_tokens"]
    assert usage["cached_tokens"] == response.raw["cached_tokens"]
    assert len(counter.llm_token_counts) == 1  # one LLM event per call: no double counting
    assert counter.prompt_llm_token_count == usage["prompt_tokens"]
    assert counter.completion_llm_token_count == usage["completion_tokens"]


def test_stream_complete_matches_complete_and_ends_with_usage(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=10)
    counter = TokenCountingHandler(tokenizer=llm.model_tokenizer_fn)
    llm.callback_manager = CallbackManager([counter])
    whole = llm.complete("Explain the for statement.")
    pieces = list(llm.stream_complete("Explain the for statement."))
    assert "".join(p.delta or "" for p in pieces) == whole.text
    assert pieces[-1].text == whole.text
    assert pieces[-1].raw["usage"]["completion_tokens"] == whole.raw["usage"]["completion_tokens"]
    assert all(not p.raw for p in pieces[:-1])
    assert counter.llm_token_counts[-1].completion_token_count == whole.raw["usage"]["completion_tokens"]


def test_stream_chat_matches_chat(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=8)
    expected = llm.chat(_messages("What is a module?")).message.content
    pieces = list(llm.stream_chat(_messages("What is a module?")))
    assert "".join(p.delta or "" for p in pieces) == expected
    assert pieces[-1].message.content == expected
    assert pieces[-1].raw["prefix_hit_tokens"] > 0


def test_async_calls_run_off_the_event_loop(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=48)
    expected = llm.chat(_messages("What is a coroutine?")).message.content

    async def scenario() -> tuple[str, int, float, str]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.002)

        task = asyncio.create_task(ticker())
        started = time.perf_counter()
        response = await llm.achat(_messages("What is a coroutine?"))
        elapsed = time.perf_counter() - started
        done.set()
        await task
        stream = await llm.astream_chat(_messages("What is a coroutine?"))
        streamed = [chunk async for chunk in stream]
        return response.message.content, ticks, elapsed, streamed[-1].message.content

    text, ticks, elapsed, streamed_text = asyncio.run(scenario())
    assert text == expected == streamed_text
    # A blocked loop cannot tick during the call; a free one ticks about every 2 ms (allow a
    # busy machine to slow that tenfold).
    assert ticks >= max(3, int(elapsed / 0.002 * 0.1))


def test_async_completion_matches_sync(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=8)
    expected = llm.complete("Define a lambda.").text

    async def scenario() -> tuple[str, str]:
        response = await llm.acomplete("Define a lambda.")
        gen = await llm.astream_complete("Define a lambda.")
        chunks = [chunk async for chunk in gen]
        return response.text, "".join(c.delta or "" for c in chunks)

    assert asyncio.run(scenario()) == (expected, expected)


def test_per_call_overrides_and_unknown_keywords(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=20)
    short = llm.complete("Tell me about classes.", max_tokens=2)
    assert short.raw["usage"]["completion_tokens"] <= 2
    baseline = llm.complete("Tell me about classes.", reuse=False)
    assert baseline.raw["cached_tokens"] == 0
    with pytest.raises(TypeError, match="unknown parameter"):
        llm.complete("x y z", frequency_penalty=0.5)


def test_bad_input_gives_clear_errors(tiny_parts) -> None:
    model = tiny_model("llama", max_position_embeddings=128)
    _, tokenizer = tiny_parts
    llm = KVBoostLLM(engine=KVBoost.from_model(model, tokenizer, show_progress=False), max_new_tokens=8)
    with pytest.raises(PromptTooLongError, match="context window"):
        llm.complete("word " * 400, formatted=True)
    with pytest.raises(ValueError, match="at least one message"):
        llm.chat([])


def test_calls_warm_and_pin_nothing(tiny_engine: KVBoost) -> None:
    # The engine stores each prompt's leading part after answering (evictable); the LLM
    # neither warms nor pins per call, so a context in the system turn cannot pile up pins.
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4)
    calls: list[str] = []
    store = tiny_engine._cache._store
    real_warm, real_pin = tiny_engine.warm, store.pin
    tiny_engine.warm = lambda text: calls.append(f"warm {text}") or real_warm(text)  # type: ignore[method-assign]
    store.pin = lambda key: calls.append(f"pin {key}") or real_pin(key)  # type: ignore[method-assign]
    try:
        llm.chat(_messages("What is a tuple?"))
        llm.complete("What is a set?")
        again = llm.chat(_messages("What is a dict?")).raw
    finally:
        del tiny_engine.warm, store.pin
    assert calls == []
    assert again["prefix_hit_tokens"] > 0  # the engine's own write-back stored the system turn


def test_names_from_before_the_shared_vocabulary_are_gone(tiny_engine: KVBoost) -> None:
    import llama_index.llms.kvboost.prewarm

    with pytest.raises(ImportError):
        from llama_index.llms.kvboost import KVBoostPrewarm  # noqa: F401
    assert not hasattr(llama_index.llms.kvboost.prewarm, "KVBoostPrewarm")
    with pytest.raises(ValueError, match=r"warm_shared_beginning\n.*Extra inputs are not permitted"):
        KVBoostLLM(engine=tiny_engine, warm_shared_beginning=True)
