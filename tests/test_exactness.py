"""Exact paths against full prefill, on tiny random-weight models of every supported family,
in float32 on the CPU and on CUDA (the ``device`` fixture; float32 on CUDA keeps the CPU's
tolerance, see ``devices.py``)."""

import pytest
import torch
from decoding_checks import check_against_full_prefill
from devices import engine_device_settings
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import UnsupportedModelError
from kvboost_rag.dev.testing import ROPE_FAMILIES, tiny_model
from kvboost_rag.hf.windows import LayerWindows

ATOL = 1e-4


def assert_close_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=ATOL, rtol=0), f"max diff {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("family", [*ROPE_FAMILIES, "gpt2"])
def test_prefix_hit_equals_full_prefill(make_engine, docs, family, device):
    engine = make_engine(family)
    prefix = rag_prompt(docs[:3], question="")[: -len("\nAnswer:")]
    warm = engine.warm(prefix)
    assert warm.new_tokens == warm.num_tokens and not warm.already_warm
    prompt = prefix + "What is described first?\nAnswer:"
    full = engine.generate(prompt, max_new_tokens=6, reuse=False, return_logits=True)
    check = check_against_full_prefill(engine, prompt, full, atol=ATOL)
    for hit in (check.forced, check.free):
        assert hit.prefix_hit_tokens >= warm.num_tokens - 1
        assert hit.strategy == "exact"
        assert_close_logits(full.first_token_logits, hit.first_token_logits)
    assert engine.warm(prefix).already_warm


@pytest.mark.parametrize("strategy", ["cacheblend", "attention"])
@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_cacheblend_full_ratio_equals_full_prefill(make_engine, docs, family, strategy, device):
    engine = make_engine(family, recompute_ratio=1.0, recompute_strategy=strategy)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    prompt = rag_prompt([docs[2], docs[0], docs[3], docs[1]])
    full = engine.generate(prompt, max_new_tokens=5, reuse=False, return_logits=True)
    check = check_against_full_prefill(engine, prompt, full, atol=ATOL)
    for blended in (check.forced, check.free):
        assert blended.strategy == strategy
        assert blended.content_hit_tokens > 0
        assert blended.recomputed_tokens == blended.content_hit_tokens
        assert_close_logits(full.first_token_logits, blended.first_token_logits)


@pytest.mark.parametrize(
    ("family", "probe"),
    [
        ("llama", {}),
        ("gemma2", {}),
        ("qwen3", {}),
        ("llama", {"probe_layers": 1, "probe_queries": 4}),
        ("qwen3", {"probe_layers": 2, "probe_weighting": "value_depth"}),
    ],
)
def test_attention_selection_pass_leaves_no_trace(make_engine, docs, family, probe, device):
    """The pass that reads the last token's attention writes the live tokens' K/V over a stale
    cache (in the layers it runs); with every cached token recomputed anyway
    (``keep_document_start`` covers them all) the result must still equal full prefill."""
    engine = make_engine(
        family, recompute_strategy="attention", recompute_ratio=0.3, keep_document_start=10_000, **probe
    )
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    prompt = rag_prompt([docs[1], docs[3], docs[0], docs[2]])
    full = engine.generate(prompt, max_new_tokens=5, reuse=False, return_logits=True)
    check = check_against_full_prefill(engine, prompt, full, atol=ATOL)
    for blended in (check.forced, check.free):
        assert blended.strategy == "attention" and blended.content_hit_tokens > 0
        assert blended.recomputed_tokens == blended.content_hit_tokens
        assert_close_logits(full.first_token_logits, blended.first_token_logits)


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_no_repair_differs_from_full_prefill(make_engine, docs, family, device):
    """The previous test could not pass by accident: without repair the logits move."""
    engine = make_engine(family, recompute_strategy="none")
    engine.warm_documents(docs[:4])
    prompt = rag_prompt([docs[3], docs[1], docs[0], docs[2]])
    full = engine.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
    raw = engine.generate(prompt, max_new_tokens=1, return_logits=True)
    assert raw.content_hit_tokens > 0 and raw.recomputed_tokens == 0
    assert (full.first_token_logits - raw.first_token_logits).abs().max() > 10 * ATOL


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_rerotated_keys_equal_fresh_keys_at_layer_zero(tokenizer, family, device):
    from kvboost_rag.hf import ModelAdapter

    adapter = ModelAdapter(tiny_model(family).to(device), tokenizer)
    ids = torch.tensor(tokenizer("def f(x):\n    return x + 1", add_special_tokens=False).input_ids)
    n = ids.numel()

    def layer0_keys(offset: int) -> torch.Tensor:
        cache = adapter.new_cache(n)
        adapter.hidden_through_layers(ids, torch.arange(offset, offset + n), cache, 0, 0, None, sparse_queries=False)
        return cache.layers[0].keys[0]

    at_3, at_517 = layer0_keys(3), layer0_keys(517)
    moved = adapter.rotate_keys(at_3.unsqueeze(0), torch.full((n,), 514)).squeeze(0)
    assert torch.allclose(moved, at_517, atol=1e-4), f"max diff {(moved - at_517).abs().max():.2e}"
    assert not torch.allclose(at_3, at_517, atol=1e-3)  # the positions really differ
    back = adapter.rotate_keys(at_517.unsqueeze(0), torch.full((n,), -514)).squeeze(0)
    assert torch.allclose(back, at_3, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "stablelm"])
def test_documents_hit_in_any_order(make_engine, docs, family, device):
    engine = make_engine(family)
    engine.warm_documents(docs[:4])
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        result = engine.generate(rag_prompt([docs[i] for i in order]), max_new_tokens=1)
        assert result.documents_found == 4
        doc_tokens = sum(engine.count_tokens(docs[i]) for i in order)
        # every document token is served from cache except boundary merges and the
        # first token of each chunk that the tokenizer may join with a separator
        assert result.content_hit_tokens >= doc_tokens - 4 * 2 - result.boundary_merged_tokens


def test_truncated_document_hits_its_leading_pieces(make_engine, docs):
    engine = make_engine("llama", chunk_size=16)
    long_doc = docs[0]
    engine.warm_documents([long_doc])
    cut = long_doc[: len(long_doc) // 2]
    result = engine.generate(rag_prompt([cut]), max_new_tokens=1)
    assert result.documents_found == 1
    assert 0 < result.content_hit_tokens <= engine.count_tokens(cut)
    assert result.content_hit_tokens >= engine.count_tokens(cut) - 3


def test_unknown_text_misses(make_engine, docs):
    engine = make_engine("llama")
    engine.warm_documents(docs[:2])
    result = engine.generate(rag_prompt([docs[4]]), max_new_tokens=1)
    assert result.documents_found == 0
    assert result.content_hit_tokens == 0


def test_explicit_documents_are_stored_for_next_time(make_engine, docs, device):
    engine = make_engine("qwen2")
    first = engine.generate(rag_prompt([docs[0], docs[1]]), max_new_tokens=1, documents=[docs[0], docs[1]])
    assert first.content_hit_tokens == 0 and first.documents_found == 2
    assert engine.is_document_warm(docs[0]) and engine.is_document_warm(docs[1])
    second = engine.generate(rag_prompt([docs[1], docs[0]]), max_new_tokens=1)
    assert second.documents_found == 2
    assert second.content_hit_tokens > 0.8 * (engine.count_tokens(docs[0]) + engine.count_tokens(docs[1]))


def test_shared_beginning_is_stored_after_generate(make_engine, docs):
    engine = make_engine("llama")
    engine.warm_documents(docs[:2])
    first = engine.generate(rag_prompt(docs[:2]), max_new_tokens=1)
    second = engine.generate(rag_prompt(docs[1::-1]), max_new_tokens=1)
    assert first.prefix_hit_tokens < second.prefix_hit_tokens
    assert second.prefix_hit_tokens >= engine.count_tokens(SYSTEM_PROMPT) - 1


def test_models_without_rope_fall_back_to_prefix_only(make_engine, docs):
    engine = make_engine("gpt2")
    engine.warm_documents(docs[:2])
    result = engine.generate(rag_prompt(docs[1::-1]), max_new_tokens=1)
    assert result.content_hit_tokens == 0
    with pytest.raises(UnsupportedModelError, match="position-independent"):
        make_engine("gpt2", strict=True)


def test_sliding_window_longer_than_prompt_reuses_documents(make_engine, docs):
    engine = make_engine("mistral")
    engine.model.config.sliding_window = 4096
    engine._adapter.windows = LayerWindows(prompt_window=4096, all_global=False)
    engine.warm_documents(docs[:2])
    assert engine.generate(rag_prompt(docs[1::-1]), max_new_tokens=1).content_hit_tokens > 0


def test_sliding_window_shorter_than_prompt_never_reuses_documents(tokenizer, docs, device):
    from kvboost_rag import KVBoost

    model = tiny_model("mistral", sliding_window=64)
    on_device = engine_device_settings(device)
    engine = KVBoost.from_model(model, tokenizer, show_progress=False, chunk_size=32, **on_device)
    engine.warm_documents(docs[:2])
    prompt = rag_prompt(docs[1::-1])
    full = engine.generate(prompt, max_new_tokens=3, reuse=False, return_logits=True)
    result = engine.generate(prompt, max_new_tokens=3, return_logits=True)
    assert result.content_hit_tokens == 0
    assert_close_logits(full.first_token_logits, result.first_token_logits)
    strict = KVBoost.from_model(model, tokenizer, show_progress=False, strict=True, **on_device)
    strict.warm_documents(docs[:2])
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        strict.generate(prompt, max_new_tokens=3)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_rerotation_uses_each_layer_types_frequencies(tokenizer, family, device):
    """Local and global layers of Gemma 3 rotate with different bases: every layer's keys
    move to the new position exactly, and a document is served at new positions even when
    the prompt is longer than the local layers' window."""
    from kvboost_rag.hf import ModelAdapter

    model = tiny_model(family).to(device)
    adapter = ModelAdapter(model, tokenizer)
    assert adapter.position_independent and adapter.windows.prompt_window is None
    ids = torch.tensor(tokenizer("def f(x):\n    return x + 1", add_special_tokens=False).input_ids)
    n = ids.numel()

    def keys_at(offset: int) -> torch.Tensor:
        cache = adapter.new_cache(n)
        adapter.hidden_through_layers(
            ids, torch.arange(offset, offset + n), cache, 0, adapter.num_layers - 1, None, sparse_queries=False
        )
        return torch.stack([layer.keys[0] for layer in cache.layers])

    before, after = keys_at(3), keys_at(700)
    # Deeper layers depend on positions through attention too; compare layer by layer on
    # the first token, whose output attends to itself only.
    for layer in range(adapter.num_layers):
        moved = adapter.rotate_keys(before[layer : layer + 1, :, :1], 697, first_layer=layer)
        assert torch.allclose(moved, after[layer : layer + 1, :, :1], atol=1e-4), f"layer {layer}"
    if family == "gemma3_text":
        assert not torch.equal(adapter._inv_freq[0], adapter._inv_freq[1])
