"""CacheBlend's gradual filtering: stage sizes, layer spans, and the cache it leaves behind."""

from __future__ import annotations

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag.prefill.prefiller import Prefiller
from kvboost_rag.repair.selection import layer_spans, stage_sizes


@pytest.mark.parametrize("budget,spans,candidates", [(60, [15, 15], 400), (33, [2, 1], 400), (10, [4, 4, 4, 4], 50)])
def test_stage_sizes_shrink_and_cost_the_budget_per_layer(budget, spans, candidates):
    sizes = stage_sizes(budget, spans, candidates)
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] > budget > sizes[-1]
    token_layers = sum(size * length for size, length in zip(sizes, spans))
    assert abs(token_layers - budget * sum(spans)) <= max(spans)


def test_stage_sizes_at_a_full_budget_recompute_every_candidate_everywhere():
    assert stage_sizes(100, [15, 15], 100) == [100, 100]
    assert stage_sizes(90, [2, 1], 100) == [100, 70]
    assert stage_sizes(0, [15, 15], 100) == [0, 0]


def test_layer_spans_cover_every_layer_once():
    for layers in (1, 2, 3, 30, 32):
        for stages in (1, 2, 3, 5):
            spans = layer_spans(layers, stages)
            covered = [layer for first, last in spans for layer in range(first, last + 1)]
            assert covered == list(range(layers))
            assert len(spans) == min(stages, layers)


def _blend_outcome(make_engine, docs, monkeypatch, **settings):
    engine = make_engine("llama", **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    outcomes = []
    steps = Prefiller.steps

    def capture(self, plan, found, **kwargs):
        outcome = yield from steps(self, plan, found, **kwargs)
        outcomes.append((outcome, outcome.keys[:, :, : plan.num_tokens].clone()))
        return outcome

    with monkeypatch.context() as patch:
        patch.setattr(Prefiller, "steps", capture)
        result = engine.generate(rag_prompt([docs[3], docs[1], docs[0], docs[2]]), max_new_tokens=1)
    (outcome, keys), = outcomes
    return result, outcome, keys


def test_tokens_that_leave_keep_cached_kv_in_the_layers_they_ran(make_engine, docs, monkeypatch):
    """No fresh-over-stale mix: a cached token that left the set after the first span has its
    cached K/V back there, so it is fresh in the first span's layers only if it is fresh in
    the last layer too (tiny models: 3 layers, spans 0..1 and 2)."""
    _, stale, stale_keys = _blend_outcome(make_engine, docs, monkeypatch, recompute_strategy="none", recompute_ratio=0.0)
    result, outcome, keys = _blend_outcome(make_engine, docs, monkeypatch, recompute_ratio=0.3, blend_stages=2)
    content = sorted({p for document in outcome.documents for p in document.positions})
    assert len(content) == outcome.content_tokens == stale.content_tokens > 0
    same = torch.isclose(keys[:, :, content], stale_keys[:, :, content], atol=1e-5, rtol=1e-4)
    fresh = ~same.all(dim=3).all(dim=1)  # [layers, content tokens]
    sizes = stage_sizes(-(-3 * len(content) // 10), [2, 1], len(content))
    assert sizes[0] > sizes[1]
    assert int(fresh[2].sum()) == sizes[1]  # the tokens that went on to the last span
    assert torch.equal(fresh[1], fresh[2])  # the others left with their cached K/V restored
    assert result.recompute_ratio == pytest.approx(0.3, abs=0.02)


def test_two_stages_cost_what_one_stage_costs(make_engine, docs, monkeypatch):
    one, _, _ = _blend_outcome(make_engine, docs, monkeypatch, recompute_ratio=0.2, blend_stages=1)
    two, _, _ = _blend_outcome(make_engine, docs, monkeypatch, recompute_ratio=0.2, blend_stages=2)
    assert abs(one.recomputed_tokens - two.recomputed_tokens) <= 2
