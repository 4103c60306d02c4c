"""The lookahead repair: stale tokens chosen by what the likely first answer token reads."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pydantic import ValidationError
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoostSettings
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.dev.threads import HUNG_SECONDS
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.prefill import prefiller as prefill_module
from kvboost_rag.hf.passes import run_now
from kvboost_rag.repair.lookahead import look_ahead_steps
from kvboost_rag.repair.probe import attention_scores, run_probe
from kvboost_rag.repair.selection import select_highest


@pytest.fixture(scope="module")
def adapter(tokenizer):
    return ModelAdapter(tiny_model("llama"), tokenizer)


def stale_prompt(adapter: ModelAdapter, n: int, capacity: int):
    """Buffers whose rows 8..n-4 were computed after another beginning (stale), the rest fresh."""
    ids = torch.arange(n) % 47 + 5
    keys, values = adapter.buffers(capacity)
    other = ids.clone()
    other[:8] = torch.arange(8) + 60  # the cached rows were computed after other tokens
    adapter.forward(other, torch.arange(n), adapter.cache_over(keys, values, 0))
    fresh_keys, fresh_values = adapter.buffers(capacity)
    logits = adapter.forward(ids, torch.arange(n), adapter.cache_over(fresh_keys, fresh_values, 0))
    keys[:, :, :8], values[:, :, :8] = fresh_keys[:, :, :8], fresh_values[:, :, :8]
    keys[:, :, n - 4 : n], values[:, :, n - 4 : n] = fresh_keys[:, :, n - 4 : n], fresh_values[:, :, n - 4 : n]
    stale = torch.zeros(n, dtype=torch.bool)
    stale[8 : n - 4] = True
    live = torch.zeros(n, dtype=torch.bool)
    live[n - 4 :] = True
    return ids, keys, values, logits, stale, live


def look_ahead(adapter, *args) -> int:
    """The lookahead repair run at once (no engine loop)."""
    return run_now(adapter, look_ahead_steps(adapter, *args))


def test_lookahead_recomputes_the_stale_tokens_the_first_answer_token_reads_most(adapter):
    n, budget = 40, 5
    ids, keys, values, logits, stale, _ = stale_prompt(adapter, n, n + 4)
    recorded = run_probe(adapter, logits.argmax().view(1), torch.tensor([n]), keys.clone(), values.clone(), n + 1)
    candidates = stale.nonzero().view(-1)
    expected = select_highest(candidates, attention_scores(recorded, candidates), budget)
    before_keys = keys.clone()

    added = look_ahead(
        adapter, int(logits.argmax()), ids, keys, values, adapter.cache_over(keys, values, n), stale, budget
    )

    assert added == budget
    changed = (keys[:, :, :n] - before_keys[:, :, :n]).abs().amax(dim=(0, 1, 3)) > 0
    assert all(changed[p] for p in expected.tolist())  # recomputed over the fresh beginning
    untouched = [p for p in candidates.tolist() if p not in set(expected.tolist())]
    assert untouched and not any(changed[p] for p in untouched)
    assert not any(changed[p] for p in range(8)) and not any(changed[p] for p in range(n - 4, n))


def test_lookahead_without_budget_stale_tokens_or_room_changes_nothing(adapter):
    n = 32
    ids, keys, values, logits, stale, _ = stale_prompt(adapter, n, n + 2)
    # Rows n.. were never written (uninitialized: NaN under the suites' poison fill); the
    # prompt's rows and the spare rows are compared apart, NaN matching NaN.
    before_keys, before_values = keys.clone(), values.clone()
    cache = adapter.cache_over(keys, values, n)
    first = int(logits.argmax())
    assert look_ahead(adapter, first, ids, keys, values, cache, stale, 0) == 0
    assert look_ahead(adapter, first, ids, keys, values, cache, torch.zeros(n, dtype=torch.bool), 4) == 0
    assert torch.equal(keys[:, :, :n], before_keys[:, :, :n]) and torch.equal(values[:, :, :n], before_values[:, :, :n])
    # nothing ran: not even the probe's row n was written
    assert same_or_both_nan(keys[:, :, n:], before_keys[:, :, n:])
    assert same_or_both_nan(values[:, :, n:], before_values[:, :, n:])
    ids, keys, values, logits, stale, _ = stale_prompt(adapter, n, n)  # no row for the probe
    before_keys, before_values = keys.clone(), values.clone()
    assert look_ahead(adapter, first, ids, keys, values, adapter.cache_over(keys, values, n), stale, 4) == 0
    assert torch.equal(keys, before_keys) and torch.equal(values, before_values)


def same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element-wise equal, a NaN counting as equal to a NaN (unwritten rows)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_lookahead_ratio_is_validated():
    assert KVBoostSettings().lookahead_ratio == 0.0
    with pytest.raises(ValidationError, match="lookahead_ratio"):
        KVBoostSettings(lookahead_ratio=-0.1)
    with pytest.raises(ValidationError, match="lookahead_ratio"):
        KVBoostSettings(lookahead_ratio=1.5)


def _rag_run(make_engine, docs, **settings):
    engine = make_engine("llama", recompute_strategy="attention", recompute_ratio=0.1, **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    return engine.generate(rag_prompt([docs[3], docs[1], docs[0], docs[2]]), max_new_tokens=6, return_logits=True)


def test_engine_runs_the_lookahead_after_the_first_token(make_engine, docs):
    plain = _rag_run(make_engine, docs)
    ahead = _rag_run(make_engine, docs, lookahead_ratio=0.05)
    loaded = plain.content_hit_tokens
    assert loaded > 0 and ahead.content_hit_tokens == loaded
    # the first token is chosen before the lookahead: same logits, same token
    assert torch.equal(ahead.first_token_logits, plain.first_token_logits)
    assert ahead.token_ids[0] == plain.token_ids[0]
    # it recomputed ceil(5%) more of the loaded tokens, which no longer count as read from cache
    assert ahead.recomputed_tokens == plain.recomputed_tokens + math.ceil(loaded * 0.05)
    assert ahead.cached_tokens == plain.cached_tokens - math.ceil(loaded * 0.05)
    # the tokens after the first read the refreshed K/V
    assert not torch.equal(ahead.step_logits[1:], plain.step_logits[1:])


def test_a_failing_lookahead_reaches_the_caller(make_engine, docs, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("lookahead failed")

    monkeypatch.setattr(prefill_module, "look_ahead_steps", fail)
    with pytest.raises(RuntimeError, match="lookahead failed"):
        _rag_run(make_engine, docs, lookahead_ratio=0.05)


def test_a_lookahead_whose_pass_fails_ends_its_request_and_the_next_one_runs(make_engine, docs):
    # The lookahead's pass (one token, attention recorded) runs before the sequence's first step;
    # when the model fails on it, the request ends with that error instead of waiting for a
    # first step that never comes, and its place goes back.
    engine = make_engine("llama", recompute_strategy="attention", recompute_ratio=0.1, lookahead_ratio=0.05)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    forward = engine._adapter.forward_segments

    def failing(segments):
        if any(segment.record and len(segment) == 1 for segment in segments):
            raise RuntimeError("the lookahead's pass failed")
        return forward(segments)

    engine._adapter.forward_segments = failing
    prompt = rag_prompt([docs[3], docs[1], docs[0], docs[2]])
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(engine.generate, prompt, max_new_tokens=6)
        with pytest.raises(RuntimeError, match="the lookahead's pass failed"):
            call.result(timeout=HUNG_SECONDS)
    engine._adapter.forward_segments = forward
    assert engine.generate(prompt, max_new_tokens=6).token_ids
