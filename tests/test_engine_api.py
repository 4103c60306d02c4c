"""The engine's public API: validation, decoding options, streaming, threads, eviction (the
calls that run the model also on CUDA, through the ``device`` fixture)."""

import threading

import pydantic
import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import (
    InvalidInputError,
    KVBoost,
    KVBoostSettings,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from kvboost_rag.dev.testing import tiny_model


@pytest.fixture
def engine(make_engine):
    return make_engine("llama")


@pytest.mark.parametrize("prompt", ["", "   ", None])
def test_empty_prompt_is_rejected(engine, prompt):
    with pytest.raises(InvalidInputError, match="non-empty"):
        engine.generate(prompt)


def test_prompt_longer_than_context_window(make_engine):
    engine = make_engine("llama")
    engine.model.config.max_position_embeddings = 64
    with pytest.raises(PromptTooLongError, match="context window is 64"):
        engine.generate("word " * 200)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"documents": "a single string"}, "documents"),
    ],
)
def test_bad_generation_arguments(engine, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        engine.generate("Hello there", **kwargs)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"recompute_strategy": "magic"}, "recompute_strategy"),
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"kv_cache_bits": 3}, "kv_cache_bits"),
        ({"device": "tpu"}, "device"),
        ({"unknown_knob": 1}, "unknown_knob"),
        ({"recompute_strategy": "selective", "recompute_ratio": "auto"}, "recompute_strategy='attention' or 'cacheblend'"),
        ({"max_stale_attention": 0.0}, "max_stale_attention"),
    ],
)
def test_bad_settings_name_the_field(settings, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        KVBoostSettings(**settings)


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_auto_ratio_is_accepted_with_a_strategy_that_measures(strategy):
    assert KVBoostSettings(recompute_strategy=strategy, recompute_ratio="auto").recompute_ratio == "auto"


def test_settings_are_validated_on_assignment(engine):
    with pytest.raises(pydantic.ValidationError):
        engine.settings.recompute_ratio = 2.0


def test_check_layer_must_exist(tokenizer):
    with pytest.raises(InvalidInputError, match="check_layer"):
        KVBoost.from_model(tiny_model("llama"), tokenizer, check_layer=7)


def test_model_without_tokenizer(tokenizer):
    with pytest.raises(UnsupportedModelError, match="tokenizer"):
        KVBoost.from_model(tiny_model("llama"), None)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError):
        KVBoost.from_pretrained(tmp_path / "missing-model")


def test_empty_document_is_rejected(engine):
    with pytest.raises(InvalidInputError, match="document 1 is empty"):
        engine.warm_documents(["real text here", "  "])


def test_stop_string_cuts_output_and_ends_decoding(engine, device):
    base = engine.generate("The value of the expression", max_new_tokens=12)
    assert len(base.output_text) > 4
    stop = base.output_text[2:4]
    cut = engine.generate("The value of the expression", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.output_text == base.output_text[: base.output_text.find(stop)]
    assert stop not in cut.output_text
    assert cut.generated_tokens < base.generated_tokens


def test_stream_pieces_join_to_the_output(engine, device):
    stream = engine.stream("The value of the expression", max_new_tokens=10)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.output_text
    assert stream.result.output_text == engine.generate("The value of the expression", max_new_tokens=10).output_text


def test_seeded_sampling_is_reproducible(engine, device):
    a = engine.generate("Import statements", max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    b = engine.generate("Import statements", max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    c = engine.generate("Import statements", max_new_tokens=8, temperature=1.0, top_p=0.9, seed=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_ttft_is_within_total_time(engine, device):
    result = engine.generate("The value of the expression", max_new_tokens=4)
    assert 0 < result.ttft_ms <= result.total_ms


def test_threads_give_the_same_outputs_as_sequential_calls(make_engine, docs, device):
    engine = make_engine("qwen2")
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    prompts = [rag_prompt([docs[i], docs[(i + 1) % 4]], question=f"q{i}") for i in range(4)]
    expected = [engine.generate(p, max_new_tokens=6).output_text for p in prompts]
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        results[i] = engine.generate(prompts[i % 4], max_new_tokens=6).output_text

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(8)] == expected + expected


def test_eviction_keeps_the_warmed_system_prompt(make_engine, docs, device):
    engine = make_engine("llama")
    per_token = 2 * 3 * 2 * 16 * 4  # K+V x layers x heads x head_dim x fp32
    engine.settings.max_cache_bytes = per_token * 400
    engine = KVBoost.from_model(engine.model, engine.tokenizer, **engine.settings.model_dump())
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs)
    stats = engine.cache_stats()
    assert stats.tiers["memory"]["evictions"] > 0
    assert stats.memory_bytes <= per_token * 400
    assert engine.warm(SYSTEM_PROMPT).already_warm


def test_verify_correctness_reports_exact_prefix_reuse(make_engine, docs, device):
    engine = make_engine("llama")
    prefix = rag_prompt(docs[:2], question="")
    engine.warm(prefix)
    report = engine.verify_correctness([prefix + " one", prefix + " two"], max_new_tokens=4)
    assert report.passed
    assert report.top1_agreement == 1.0 and report.output_agreement == 1.0
    assert report.mean_first_token_kl < 1e-6
    assert all(c.kv_reuse_ratio > 0.9 for c in report.checks)


def test_verify_correctness_flags_unrepaired_reuse(make_engine, docs, device):
    engine = make_engine("llama", recompute_strategy="none")
    engine.warm_documents(docs[:4])
    report = engine.verify_correctness([rag_prompt(docs[3::-1])], max_new_tokens=2, kl_tolerance=1e-6)
    assert report.checks[0].first_token_kl > 1e-6
    assert not report.passed


def test_cache_stats_count_hits(make_engine, docs, device):
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:2])
    engine.generate(rag_prompt(docs[1::-1]), max_new_tokens=1)
    stats = engine.cache_stats()
    assert stats.documents == 2
    assert stats.counters["prefix_hit_tokens"] > 0
    assert stats.counters["content_hit_tokens"] > 0
    assert stats.tiers["device" if device == "cuda" else "memory"]["hits"] > 0  # the top tier holds what was warmed


def test_full_prefill_baseline_neither_reads_nor_writes_the_cache(make_engine, docs, device):
    engine = make_engine("llama")
    before = engine.cache_stats()
    result = engine.generate(rag_prompt(docs[:2]), max_new_tokens=2, reuse=False)
    assert result.cached_tokens == 0 and result.strategy == "full"
    assert engine.cache_stats().entries == before.entries


def test_first_token_logits_only_on_request(engine, device):
    assert engine.generate("abc def", max_new_tokens=1).first_token_logits is None
    logits = engine.generate("abc def", max_new_tokens=1, return_logits=True).first_token_logits
    assert isinstance(logits, torch.Tensor) and logits.shape == (len(engine.tokenizer),)


def test_closing_a_stream_stops_decoding(engine, device):
    stream = engine.stream("The value of the expression", max_new_tokens=50)
    first = next(stream)
    assert isinstance(first, str)
    stream.close()
    with pytest.raises(StopIteration):
        next(stream)
    assert stream.result is None


def test_documents_are_warmed_behind_the_latest_shared_beginning(make_engine, docs):
    engine = make_engine("llama")
    assert engine.document_context.startswith("Reference documents")
    engine.warm(SYSTEM_PROMPT)
    assert engine.document_context == SYSTEM_PROMPT
    pinned = make_engine("llama", warm_prefix="Fixed lead-in:\n")
    pinned.warm(SYSTEM_PROMPT)
    assert pinned.document_context == "Fixed lead-in:\n"


def test_documents_still_hit_after_a_new_system_prompt(make_engine, docs, device):
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:2])
    engine.warm("A different system prompt for another chain.")
    assert all(engine.is_document_warm(d) for d in docs[:2])
    result = engine.generate("A different system prompt for another chain.\n\n" + "\n\n".join(docs[1::-1]) + "\nQ?", max_new_tokens=1)
    assert result.documents_found == 2 and result.content_hit_tokens > 0


def test_empty_warm_prefix_warms_documents_alone(make_engine, docs, device):
    engine = make_engine("llama", warm_prefix="")
    [result] = engine.warm_documents(docs[:1])
    assert result.new_tokens == result.num_tokens > 0
    assert engine.generate(rag_prompt(docs[:1]), max_new_tokens=1).content_hit_tokens > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),  # beyond torch's generators: named before any prefill
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"top_p": float("nan")}, "top_p"),
        ({"reuse": "yes"}, "reuse"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_option_values_are_named_not_coerced(engine, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        engine.generate("Hello there", **kwargs)


def test_the_seed_range_is_what_torch_takes(engine):
    for seed in (2**64 - 1, -(2**63)):
        result = engine.generate("Hello there", max_new_tokens=2, temperature=1.0, seed=seed)
        assert len(result.token_ids) == 2


def test_one_stop_string_is_one_stop_string(engine, device):
    free = engine.generate("Hello there", max_new_tokens=12)
    word = free.output_text[3:6]
    assert len(word) == 3
    cut = engine.generate("Hello there", max_new_tokens=12, stop=word)
    assert cut.finish_reason == "stop" and word not in cut.output_text
    assert cut.output_text == free.output_text[: free.output_text.index(word)]


def test_options_object_and_overrides(engine):
    from kvboost_rag.request.options import GenerationOptions

    options = GenerationOptions(max_new_tokens=3)
    assert engine.generate("Hello there", options).generated_tokens <= 3
    assert engine.generate("Hello there", options, max_new_tokens=1).generated_tokens <= 1
    with pytest.raises(InvalidInputError, match="GenerationOptions"):
        engine.generate("Hello there", {"max_new_tokens": 3})


@pytest.mark.parametrize("where", ["prompt", "warm", "document"])
def test_lone_surrogates_are_invalid_input(engine, where):
    bad = "Text with a lone surrogate \ud800 in the middle of it, long enough to be a document."
    with pytest.raises(InvalidInputError, match="surrogate"):
        if where == "prompt":
            engine.generate(bad)
        elif where == "warm":
            engine.warm(bad)
        else:
            engine.warm_documents([bad])


def test_warm_documents_rejects_one_string(engine):
    with pytest.raises(InvalidInputError, match="not one string"):
        engine.warm_documents("a single document passed without a list around it")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_invalid_input(tokenizer):
    with pytest.raises(InvalidInputError, match="no cuda device"):
        KVBoost.from_model(tiny_model("llama"), tokenizer, device="cuda")


def test_pinned_overflow_evicts_the_oldest_pin_with_one_warning(caplog):
    from kvboost_rag.cache.storage import MemoryTier, StoredEntry

    def entry() -> StoredEntry:
        return StoredEntry({"keys": torch.zeros(250, dtype=torch.float32)})

    tier = MemoryTier(max_bytes=2000)
    for key in ("a", "b"):
        tier.put(key, entry())
        assert tier.pin(key)
    with caplog.at_level("WARNING", logger="kvboost_rag.cache.storage.memory"):
        evicted = tier.put("c", entry())
        assert evicted == ["a"] and "c" in tier and "b" in tier
        assert tier.pin("c")
        for i in range(50):  # every put now has to push out a pin
            tier.put(f"x{i}", entry())
            assert tier.pin(f"x{i}")
        assert len(tier) == 2 and f"x{i}" in tier
    records = [r for r in caplog.records if "pinned" in r.getMessage()]
    assert len(records) == 1


def test_tokens_the_repair_recomputes_do_not_count_as_read_from_cache(make_engine, docs, device):
    engine = make_engine("llama", recompute_ratio=0.3)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    result = engine.generate(rag_prompt([docs[2], docs[0], docs[3], docs[1]]), max_new_tokens=1)
    assert result.content_hit_tokens > 0 and result.recomputed_tokens > 0
    assert result.cached_tokens == result.prefix_hit_tokens + result.content_hit_tokens - result.recomputed_tokens
    assert result.kv_reuse_ratio == pytest.approx(result.cached_tokens / result.prompt_tokens)


def test_document_longer_than_the_context_window_is_warmed_once_up_to_it(make_engine, caplog, device):
    engine = make_engine("llama")
    engine.model.config.max_position_embeddings = 128
    document = " ".join(f"item{i} holds value {i * 7}." for i in range(120))
    first = engine.warm_documents([document])[0]
    assert first.num_tokens > engine.context_window
    assert 0 < first.new_tokens < engine.context_window
    assert first.skipped_tokens > 0 and first.new_tokens + first.skipped_tokens == first.num_tokens
    again = engine.warm_documents([document])[0]
    assert again.already_warm and again.new_tokens == 0
    assert again.cached_tokens == first.new_tokens and again.skipped_tokens == first.skipped_tokens


def test_loaded_kv_bytes_count_the_rows_copied_from_the_cache(make_engine, docs):
    """A miss copies nothing; an exact prefix repeat copies its prefix rows; a prompt of
    documents found by content copies those rows too: each a row's K and V in the buffers'
    dtype, counted once."""
    from kvboost_rag.dev.testing import tiny_config

    engine = make_engine()
    config = tiny_config("llama")
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    row = 2 * config.num_hidden_layers * heads * dim * 4  # float32 buffers
    prompt = "A prompt seen once, then repeated word for word. " * 4
    miss = engine.generate(prompt, max_new_tokens=2)
    repeat = engine.generate(prompt, max_new_tokens=2)
    assert miss.loaded_kv_bytes == 0 and repeat.prefix_hit_tokens > 0
    assert repeat.loaded_kv_bytes == repeat.prefix_hit_tokens * row
    engine.warm_documents(docs[:2])
    found = engine.generate(f"{docs[1]}\n\n{docs[0]}\n\nWhich is first?", max_new_tokens=2)
    assert found.content_hit_tokens > 0
    assert found.loaded_kv_bytes == (found.prefix_hit_tokens + found.content_hit_tokens) * row
