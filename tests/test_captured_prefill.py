"""Prefill passes as captured steps (``captured_prefill_buckets``): the tokens after an exact
prefix hit, the attention repair's probe and the blend pass of a document repair run as one
compiled graph each over the request's slot and give what the eager passes give (the probe's
recorded attention within float32 rounding; first-token logits within float32 rounding, the
same greedy tokens, the same reuse figures), on a global-attention family and one with
sliding windows; a pass longer than the largest bucket, and a prompt with nothing cached, run
eagerly.

On the CPU the steps compile with ``aot_eager`` (as in test_captured_decoding.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from test_draft_decoding import assert_same_greedy

import kvboost_rag.engine as engine_module
from kvboost_rag import KVBoost
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.hf.captured import build_captured_rows
from kvboost_rag.repair.probe import run_probe

SETTINGS = dict(
    show_progress=False, chunk_size=32, captured_pool_bytes=32 * 2**20, captured_token_buckets=(1,),
    captured_prefill_buckets=(16, 64), draft_tokens=0, captured_build="at_load",
)
FAMILIES = ("llama", "gemma2")


@pytest.fixture(scope="module")
def engines(tokenizer, docs):
    """``family -> (engine with captured prefill passes, eager engine)``, warmed alike; every test
    sends the same prompts to both, so their caches stay alike in any order of the tests."""
    from kvboost_rag.dev.testing import tiny_model

    patch = pytest.MonkeyPatch()
    patch.setattr(engine_module, "build_captured_rows", functools.partial(build_captured_rows, backend="aot_eager"))
    built = {}
    for family in FAMILIES:
        captured = KVBoost.from_model(tiny_model(family), tokenizer, captured_steps="on", **SETTINGS)
        eager = KVBoost.from_model(tiny_model(family), tokenizer, **{**SETTINGS, "captured_prefill_buckets": ()})
        assert captured._captured_prefill is not None and eager._captured_prefill is None
        for engine in (captured, eager):
            engine.warm(SYSTEM_PROMPT)
            engine.warm_documents(docs[:4])
        built[family] = (captured, eager)
    patch.undo()
    return built


def _passes(engine: KVBoost) -> int:
    return engine._captured_prefill.runs + engine._captured_probe.runs


def _same(result, reference) -> None:
    """The same prefill (what was reused and recomputed), first-token logits within float32
    rounding, greedy tokens up to a near tie."""
    for field in ("strategy", "prefix_hit_tokens", "content_hit_tokens", "recomputed_tokens"):
        assert getattr(result, field) == getattr(reference, field), field
    torch.testing.assert_close(result.step_logits[0], reference.step_logits[0], rtol=0, atol=1e-4)
    assert_same_greedy(result.token_ids, reference.token_ids, reference.step_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_hit_and_a_blend_pass_run_captured_as_the_eager_passes(engines, docs, family):
    captured, eager = engines[family]
    repeated = SYSTEM_PROMPT + "\n\nQuestion: what is a list comprehension?\nAnswer:"
    reordered = rag_prompt([docs[2], docs[0]], "Which one is about loops?")
    for prompt, passes in ((repeated, 1), (repeated, 1), (reordered, 2)):  # a repair: the probe and the blend
        before = _passes(captured)
        result = captured.generate(prompt, max_new_tokens=10, return_logits=True)
        reference = eager.generate(prompt, max_new_tokens=10, return_logits=True)
        _same(result, reference)
        assert result.prefix_hit_tokens > 0 and _passes(captured) == before + passes
        if passes == 1:
            assert result.strategy == "exact"
        else:
            assert result.strategy == "attention" and result.content_hit_tokens > 0 and result.recomputed_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_captured_probe_records_what_the_eager_probe_records(engines, docs, family, monkeypatch):
    captured, eager = engines[family]
    prefiller = captured._requests.prefiller
    adapter, pool = prefiller.adapter, prefiller.captured_probe.pool
    compared = []

    def probe_both(slot, length, tokens, positions, queries):
        keys, values = (t.clone() for t in pool.buffers(slot))  # the slot as stitched, before either probe writes
        recorded = original(slot, length, tokens, positions, queries)
        eager = run_probe(adapter, tokens, positions, keys, values, length, queries=queries)
        assert recorded is not None and len(recorded) == len(eager) == adapter.num_layers
        for got, want in zip(recorded, eager):
            torch.testing.assert_close(got, want[:length], rtol=1e-5, atol=1e-6)
        compared.append(length)
        return recorded

    original = prefiller._captured_probe
    monkeypatch.setattr(prefiller, "_captured_probe", probe_both)
    prompt = rag_prompt([docs[3], docs[1]], "What is compared?")
    result = captured.generate(prompt, max_new_tokens=2)
    assert result.strategy == "attention" and compared
    eager.generate(prompt, max_new_tokens=2)  # both engines store the same chunks, whatever test runs next


@pytest.mark.parametrize("family", FAMILIES)
def test_passes_longer_than_the_largest_bucket_and_full_prefills_run_eagerly(engines, docs, family):
    captured, eager = engines[family]
    fresh = "Unrelated text that no tier holds. " * 12  # no prefix hit: a full prefill
    long_tail = SYSTEM_PROMPT + "\n\n" + " ".join(d[::-1] for d in docs[4:6]) * 2 + "\nAnswer:"
    for prompt in (fresh, long_tail):
        before = _passes(captured)
        result = captured.generate(prompt, max_new_tokens=6, return_logits=True)
        _same(result, eager.generate(prompt, max_new_tokens=6, return_logits=True))
        assert _passes(captured) == before
    assert captured.count_tokens(long_tail) - captured.count_tokens(SYSTEM_PROMPT) > 64


def test_prefill_buckets_are_powers_of_two_up_to_8192():
    from kvboost_rag.config import KVBoostSettings

    assert KVBoostSettings(captured_prefill_buckets=(256, 64, 64)).captured_prefill_buckets == (64, 256)
    assert KVBoostSettings().captured_prefill_buckets == ()
    for bad in ((48,), (16384,), (0,)):
        with pytest.raises((InvalidInputError, ValueError), match="captured_prefill_buckets"):
            KVBoostSettings(captured_prefill_buckets=bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_passes_in_chunks_give_what_one_pass_gives(engines, docs, family):
    captured, eager = engines[family]
    prompt = rag_prompt([docs[3], docs[1]], "Which of them is about classes?")
    captured.settings.prefill_chunk_tokens = 16  # read at every call: the blend pass runs in chunks
    try:
        before = captured._captured_prefill.runs
        result = captured.generate(prompt, max_new_tokens=6, return_logits=True)
        chunks = captured._captured_prefill.runs - before
    finally:
        captured.settings.prefill_chunk_tokens = "auto"
    reference = eager.generate(prompt, max_new_tokens=6, return_logits=True)
    _same(result, reference)
    assert result.strategy == "attention" and chunks > 1


def test_a_model_of_another_class_loaded_later_recompiles_no_bucket(engines, docs):
    """Dynamo guards on transformers' registry of each model class's recordable outputs; a
    model of a new class (here a fresh family) grows it, and the built buckets must not
    recompile on the next request (minutes with inductor, in the request's path)."""
    from torch._dynamo.utils import counters

    from kvboost_rag.dev.testing import tiny_model

    captured, eager = engines["llama"]
    prompt = SYSTEM_PROMPT + "\n\nQuestion: what does a for statement do?\nAnswer:"
    captured.generate(prompt, max_new_tokens=4)  # every bucket this prompt uses has run once
    eager.generate(prompt, max_new_tokens=4)
    compiled = counters["stats"]["unique_graphs"]
    tiny_model("qwen3")  # a class no test of this module loaded
    before = _passes(captured)
    result = captured.generate(prompt, max_new_tokens=4, return_logits=True)
    _same(result, eager.generate(prompt, max_new_tokens=4, return_logits=True))
    assert _passes(captured) > before and counters["stats"]["unique_graphs"] == compiled
