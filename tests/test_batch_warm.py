"""Warming documents several at a time (their prefills packed into shared passes by the engine
loop) stores the K/V a one-by-one warm stores."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.warming.batch import batches

#: Float rounding differs between a packed pass and single rows (other matrix shapes), nothing else.
ATOL = 1e-5


def count_segments(engine: KVBoost) -> list[int]:
    """Record how many segments each forward pass of ``engine`` carries (from now on)."""
    counts: list[int] = []
    adapter = engine._adapter
    real = adapter.forward_segments

    def counting(segments):
        counts.append(len(segments))
        return real(segments)

    adapter.forward_segments = counting
    return counts


def _documents() -> list[str]:
    # Different lengths, so rows are padded, and some longer than one chunk.
    return [text[: 120 + 70 * i] for i, text in enumerate(python_reference_documents(max_chars=900)[:6])]


def _stored(engine: KVBoost, text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    record = engine._cache.index.known_documents().lookup(text)
    assert record is not None
    blocks = [engine._cache.load(key) for key in record.chunk_keys]
    assert all(block is not None for block in blocks)
    return [(block.keys, block.values) for block in blocks]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2"])
def test_warming_several_at_once_stores_what_one_by_one_warm_stores(tokenizer, family: str) -> None:
    """Gemma 2's sliding-window layers too: each document attends over its own K/V, within
    each layer's window."""
    model = tiny_model(family)
    one = KVBoost.from_model(model, tokenizer, chunk_size=32, show_progress=False, warm_batch_tokens=0)
    many = KVBoost.from_model(model, tokenizer, chunk_size=32, show_progress=False)
    texts = _documents()
    singles = one.warm_documents(texts)
    passes = count_segments(many)
    batched = many.warm_documents(texts)
    assert max(passes) > 1, "no pass carried several documents"
    assert [r.new_tokens for r in batched] == [r.new_tokens for r in singles] == [one.count_tokens(t) for t in texts]
    for text in texts:
        for (k1, v1), (k2, v2) in zip(_stored(one, text), _stored(many, text), strict=True):
            assert k1.shape == k2.shape
            torch.testing.assert_close(k2, k1, atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(v2, v1, atol=ATOL, rtol=1e-4)
    again = many.warm_documents(texts)
    assert all(r.already_warm and r.new_tokens == 0 for r in again)


def test_batches_respect_the_token_budget_and_keep_every_job() -> None:
    class Plan:
        def __init__(self, n: int) -> None:
            self.num_tokens = n

    class Job:
        def __init__(self, index: int, n: int) -> None:
            self.index, self.plan = index, Plan(n)

    jobs = [Job(i, n) for i, n in enumerate([50, 300, 40, 120, 60, 900])]
    groups = batches(jobs, 400)
    assert sorted(j.index for g in groups for j in g) == list(range(6))
    assert all(sum(j.plan.num_tokens for j in g) <= 400 or len(g) == 1 for g in groups)
    assert [[j.plan.num_tokens for j in g] for g in groups] == [[40, 50, 60, 120], [300], [900]]
    assert [len(g) for g in batches(jobs, 0)] == [1] * 6


def test_progress_counts_documents(tokenizer, monkeypatch) -> None:
    import kvboost_rag.warming.documents as engine_module

    totals: list[tuple[int, int]] = []
    real = engine_module.tqdm

    class Recording(real):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            totals.append((self.total, self.n))
            super().close()

    monkeypatch.setattr(engine_module, "tqdm", Recording)
    engine = KVBoost.from_model(tiny_model("llama"), tokenizer, chunk_size=32, show_progress=False)
    engine.warm_documents(_documents()[:2])
    engine.warm_documents(_documents(), show_progress=True)
    assert totals and totals[-1] == (6, 6)  # documents, not batches


def test_a_text_repeated_in_one_call_is_computed_once(tokenizer) -> None:
    engine = KVBoost.from_model(tiny_model("llama"), tokenizer, chunk_size=32, show_progress=False)
    text = _documents()[1]
    first, repeat = engine.warm_documents([text, text])
    n = engine.count_tokens(text)
    assert (first.new_tokens, first.already_warm) == (n, False)
    assert (repeat.new_tokens, repeat.cached_tokens, repeat.already_warm) == (0, n, True)
