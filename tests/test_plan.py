"""The prompt plan (pure) and the one-way flow: text -> plan -> prefill -> decode -> write-back."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import BaseModel
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag.cache.storage.memory import MemoryTier
from kvboost_rag.dev.threads import wait_for
from kvboost_rag.request.documents import DocumentRegistry, make_record
from kvboost_rag.request.hashing import prefix_hash, root_hash
from kvboost_rag.request.plan import PromptTokens, build_plan

ROOT = root_hash("fp")


def _tokens(tokenizer, text: str) -> PromptTokens:
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    return PromptTokens(text, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])


def _registry(tokenizer, docs: list[str], chunk_size: int) -> DocumentRegistry:
    registry = DocumentRegistry()
    for text in docs:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        registry.register(make_record(text, enc["input_ids"], enc["offset_mapping"], "fp", chunk_size))
    return registry


def test_prefix_grid_is_the_hash_chain_walked_once(tokenizer):
    tokens = _tokens(tokenizer, SYSTEM_PROMPT * 6)
    n = len(tokens)
    plan = build_plan(tokens, root=ROOT, chunk_size=16, registry=None)
    assert plan.lookup_limit == n - 1 and plan.shared_end == n
    parent = ROOT
    for i, chunk in enumerate(plan.prefix_chunks):
        assert (chunk.start, chunk.stop, chunk.parent) == (16 * i, 16 * (i + 1), parent)
        assert chunk.key == prefix_hash(parent, tokens.ids[chunk.start : chunk.stop])
        parent = chunk.key
    assert plan.prefix_chunks[-1].stop + 16 > n - 1
    # The stored grid shares the lookup keys and ends with the short chunk up to the end.
    assert plan.stored_prefix[: len(plan.prefix_chunks)] == plan.prefix_chunks
    last = plan.stored_prefix[-1]
    assert last.stop == n and last.key == prefix_hash(last.parent, tokens.ids[last.start : n])
    # The tail chunk is the short piece from the last grid point to the lookup limit.
    tail = plan.prefix_tail
    assert tail is not None and (tail.start, tail.stop) == (plan.prefix_chunks[-1].stop, n - 1)


def test_documents_are_placed_and_aligned_in_any_order(tokenizer, docs):
    registry = _registry(tokenizer, docs[:4], chunk_size=16)
    prompt = rag_prompt([docs[2], docs[0], docs[3]])
    tokens = _tokens(tokenizer, prompt)
    plan = build_plan(tokens, root=ROOT, chunk_size=16, registry=registry)
    assert [d.record.text for d in plan.documents] == [docs[2], docs[0], docs[3]]
    for document in plan.documents:
        assert document.char_start == prompt.index(document.record.text)
        assert tokens.offsets[document.first_token][1] > document.char_start
        assert tokens.offsets[document.first_token - 1][1] <= document.char_start
        for j, k in zip(document.positions, document.rows):
            assert tokens.ids[j] == document.record.token_ids[k]
        assert len(document.positions) + document.merged_tokens == len(document.record.token_ids)
    # Exactness (and the stored prefix) ends where the first document starts.
    assert plan.shared_end == plan.documents[0].first_token
    assert plan.stored_prefix[-1].stop == plan.shared_end
    assert plan.documents_after(plan.documents[1].first_token) == list(plan.documents[1:])


def test_chunk_span_needs_every_token_of_the_chunk_in_a_row(tokenizer, docs):
    registry = _registry(tokenizer, docs[:1], chunk_size=8)
    tokens = _tokens(tokenizer, rag_prompt(docs[:1]))
    document = build_plan(tokens, root=ROOT, chunk_size=8, registry=registry).documents[0]
    spans = [document.chunk_span(c) for c in range(len(document.record.chunk_keys))]
    for chunk, first in enumerate(spans):
        if first is not None:
            lo = chunk * 8
            hi = min(lo + 8, len(document.record.token_ids))
            assert tokens.ids[first : first + hi - lo] == list(document.record.token_ids[lo:hi])
    assert spans[0] == document.first_token
    # A document cut short in the prompt has no span for the chunks it lost.
    half = docs[0][: len(docs[0]) // 2]
    cut = build_plan(_tokens(tokenizer, SYSTEM_PROMPT + "\n\n" + half), root=ROOT, chunk_size=8, registry=registry)
    assert cut.documents[0].chunk_span(len(document.record.chunk_keys) - 1) is None


def test_a_repeat_hits_all_but_the_last_token_only_of_a_prompt_stored_whole_and_not_warmed(tokenizer, docs):
    """A prompt without documents is stored whole and looked up to its last token: asked again
    it hits all but that token. A document in it, or a warm's lookup of every token, does not."""
    plain = _tokens(tokenizer, SYSTEM_PROMPT * 6)
    assert build_plan(plain, root=ROOT, chunk_size=16, registry=None).repeat_hits_all_but_last
    warm = build_plan(plain, root=ROOT, chunk_size=16, registry=None, lookup_limit=len(plain))
    assert not warm.repeat_hits_all_but_last
    registry = _registry(tokenizer, docs[:2], chunk_size=16)
    with_documents = build_plan(_tokens(tokenizer, rag_prompt(docs[:2])), root=ROOT, chunk_size=16, registry=registry)
    assert with_documents.documents and not with_documents.repeat_hits_all_but_last


def test_no_document_search_without_content_reuse(tokenizer, docs):
    registry = _registry(tokenizer, docs[:2], chunk_size=16)
    tokens = _tokens(tokenizer, rag_prompt(docs[:2]))
    plan = build_plan(tokens, root=ROOT, chunk_size=16, registry=registry, content_reuse=False)
    assert plan.documents == () and plan.shared_end == len(tokens)


def test_warming_the_same_text_again_writes_nothing(make_engine, monkeypatch):
    written: list[int] = []
    original = MemoryTier.put

    def counting_put(self, key, entry):
        written.append(entry.nbytes)
        return original(self, key, entry)

    monkeypatch.setattr(MemoryTier, "put", counting_put)
    engine = make_engine("llama")
    first = engine.warm(SYSTEM_PROMPT * 3)
    assert first.new_tokens == first.num_tokens and sum(written) > 0
    before = sum(written)
    results = [engine.warm(SYSTEM_PROMPT * 3) for _ in range(100)]
    assert sum(written) == before
    assert all(r.already_warm and r.new_tokens == 0 for r in results)


def test_warmed_beginning_is_pinned_and_survives_eviction(make_engine, docs):
    engine = make_engine("llama", max_cache_bytes=150_000)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs)  # more than the budget holds: unpinned entries are evicted
    assert engine.cache_stats().tiers["memory"]["evictions"] > 0
    again = engine.warm(SYSTEM_PROMPT)
    assert again.already_warm and again.new_tokens == 0


def test_generate_flows_one_way(make_engine, docs):
    """One prompt enters each stage once, in order: text -> plan -> lookup (prefill, cache
    manager) -> stitch -> repair -> decode -> write-back, on the request's thread and the engine
    loop's; nothing calls back into the engine facade or the request lifecycle."""
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:3])
    prompt = rag_prompt([docs[2], docs[0], docs[1]])
    calls: list[tuple[str, str, str]] = []

    def module_of(frame) -> str:
        return frame.f_globals.get("__name__", "")

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = module_of(frame)
        caller = module_of(frame.f_back) if frame.f_back is not None else ""
        if callee.startswith("kvboost_rag.") and caller.startswith("kvboost_rag.") and callee != caller:
            calls.append((caller, callee, frame.f_code.co_name))

    with profiled(engine, profile):
        result = engine.generate(prompt, max_new_tokens=4)
    assert result.content_hit_tokens > 0 and result.strategy == "attention"
    # The stream the lifecycle returns drives the lifecycle's own generator (a resumption, not
    # a call back): that pair alone is allowed.
    driving = ("kvboost_rag.generation.stream", "kvboost_rag.generation.lifecycle", "_run")
    back = [
        c for c in calls
        if c[1] in ("kvboost_rag.engine", "kvboost_rag.generation.lifecycle") and c[0] != "kvboost_rag.engine" and c != driving
    ]
    assert back == [], f"calls back into the facade or the lifecycle: {sorted(set(back))}"

    entries = {
        ("kvboost_rag.request.text", "prompt"): "text",
        ("kvboost_rag.request.plan", "plan"): "plan",
        ("kvboost_rag.prefill.prefiller", "lookup"): "prefill",
        ("kvboost_rag.cache.manager", "match_prefix"): "lookup",
        ("kvboost_rag.cache.manager", "load"): "lookup",
        ("kvboost_rag.prefill.stitch", "stitch_documents"): "stitch",
        ("kvboost_rag.repair.attention", "choose"): "repair",
        ("kvboost_rag.decode.step", "choose"): "decode",
        ("kvboost_rag.cache.manager", "write_back"): "write-back",
    }
    flow: list[str] = []
    for _, callee, name in calls:
        stage = entries.get((callee, name))
        if stage is not None and (not flow or flow[-1] != stage):
            flow.append(stage)
    assert flow == ["text", "plan", "prefill", "lookup", "stitch", "repair", "decode", "write-back"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_document_warm_goes_through_prefill_and_hits_next_prompt(make_engine, docs, family):
    engine = make_engine(family)
    engine.warm(SYSTEM_PROMPT)
    first = engine.warm_documents(docs[:2])
    assert all(r.new_tokens == r.num_tokens and not r.already_warm for r in first)
    again = engine.warm_documents(docs[:2])
    assert all(r.already_warm and r.new_tokens == 0 and r.cached_tokens == r.num_tokens for r in again)
    result = engine.generate(rag_prompt(docs[:2][::-1]), max_new_tokens=2)
    assert result.content_hit_tokens > 0 and result.documents_found == 2


def test_adaptive_budget_recomputes_until_the_deviation_left_is_small():
    import torch

    from kvboost_rag.repair.selection import adaptive_budget

    deviation = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    scale = torch.ones(8)
    # Total 16 over 8 tokens: recomputing the top k leaves (16 - top-k sum) / 8.
    assert adaptive_budget(deviation, scale, target=2.0, low=0, high=8) == 0
    assert adaptive_budget(deviation, scale, target=1.0, low=0, high=8) == 1
    assert adaptive_budget(deviation, scale, target=0.5, low=0, high=8) == 2
    assert adaptive_budget(deviation, scale, target=0.1, low=0, high=8) == 5
    assert adaptive_budget(deviation, scale, target=0.1, low=0, high=3) == 3
    assert adaptive_budget(deviation, scale, target=2.0, low=2, high=8) == 2
    # Relative: the same deviation on a token with 4x the norm counts a quarter.
    assert adaptive_budget(torch.tensor([4.0, 1.0]), torch.tensor([4.0, 1.0]), 0.5, 0, 2) == 1


def test_budget_for_left_recomputes_until_the_attention_left_is_small():
    import torch

    from kvboost_rag.repair.selection import budget_for_left

    attention = torch.tensor([0.0, 0.05, 0.2, 0.1, 0.05, 0.1])  # 0.5 of the attention on cached tokens
    assert budget_for_left(attention, 0.5, low=0, high=6) == 0
    assert budget_for_left(attention, 0.3, low=0, high=6) == 1  # 0.2 recomputed, 0.3 left
    assert budget_for_left(attention, 0.2, low=0, high=6) == 2  # the two 0.1s tie
    assert budget_for_left(attention, 0.1, low=0, high=6) == 3
    assert budget_for_left(attention, 0.01, low=0, high=6) == 5
    assert budget_for_left(attention, 0.01, low=0, high=2) == 2
    assert budget_for_left(attention, 0.5, low=3, high=6) == 3
    assert budget_for_left(attention[:0], 0.1, low=0, high=6) == 0


@pytest.mark.parametrize(
    ("strategy", "target_field", "targets"),
    [("cacheblend", "max_deviation", (0.5, 0.05, 0.0001)), ("attention", "max_stale_attention", (0.9, 0.2, 0.001))],
)
def test_auto_ratio_grows_with_a_tighter_target(make_engine, docs, strategy, target_field, targets):
    budgets = []
    for target in targets:
        engine = make_engine(
            "llama", recompute_strategy=strategy, recompute_ratio="auto", min_recompute_ratio=0.0, **{target_field: target}
        )
        engine.warm(SYSTEM_PROMPT)
        engine.warm_documents(docs[:4])
        result = engine.generate(rag_prompt([docs[3], docs[1], docs[0], docs[2]]), max_new_tokens=1)
        assert result.content_hit_tokens > 0
        assert result.recompute_ratio == pytest.approx(result.recomputed_tokens / result.content_hit_tokens)
        assert 0.0 <= result.recompute_ratio <= 0.5 + 1e-9
        budgets.append(result.recomputed_tokens)
    assert budgets[0] <= budgets[1] <= budgets[2] and budgets[0] < budgets[2]


STAGE_PACKAGES = ("request", "cache", "prefill", "repair", "decode")
ROOT_DIR = Path(__file__).resolve().parents[1] / "kvboost_rag"


def _handoffs(engine, prompt: str) -> tuple[list[str], list[str]]:
    """The stage packages the lifecycle (or the facade) hands one ``generate`` to, and those
    prefill hands its prompt to, in order, consecutive repeats (the decode loop) collapsed.
    Calls into the model boundary (``hf``), diagnosis and the top-level modules are services,
    not stages; reading a data product (a method of a dataclass or a pydantic model: a plan, a
    record, options) is not a hand-off."""
    orchestrated: list[str] = []
    by_prefill: list[str] = []

    def package(frame) -> str:
        """``request`` for ``kvboost_rag.request`` and its modules; ``""`` for a top-level
        module (the facade and the services); ``"-"`` outside the engine."""
        parts = frame.f_globals.get("__name__", "").split(".")
        if parts[0] != "kvboost_rag":
            return "-"
        return parts[1] if len(parts) > 1 and (ROOT_DIR / parts[1]).is_dir() else ""

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = package(frame), package(frame.f_back)
        me = frame.f_locals.get("self")
        if callee not in STAGE_PACKAGES or callee == caller:
            return
        if me is not None and (dataclasses.is_dataclass(me) or isinstance(me, BaseModel)):
            return
        walk = orchestrated if caller in ("generation", "") else by_prefill if caller == "prefill" else None
        if walk is not None and (not walk or walk[-1] != callee):
            walk.append(callee)

    with profiled(engine, profile):
        result = engine.generate(prompt, max_new_tokens=4)
    assert result.content_hit_tokens > 0 and result.generated_tokens == 4
    return orchestrated, by_prefill


@contextmanager
def profiled(engine, profile) -> Iterator[None]:
    """``profile`` on this thread and on the engine loop's (started afresh, after the work
    before it left), for the duration."""
    wait_for(lambda: not engine._loop.active)
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        wait_for(lambda: not engine._loop.active)


def test_one_prompt_enters_each_stage_package_once(make_engine, docs):
    """Handed from stage to stage, one prompt enters each stage package once, in order:
    request (options, tokens, plan), prefill (the lookup on the request's thread, then its
    passes on the engine loop's), decoding (the first token, its steps and the pieces read
    back: one stage), then the cache (counters and write-back, after the answer). Prefill
    hands the prompt to the cache once (lookup, every chunk in one pass) and then to the
    repair. No package is entered again after the walk left it; the place in the batch is
    the engine loop's (not a stage)."""
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:3])
    orchestrated, by_prefill = _handoffs(engine, rag_prompt([docs[2], docs[0], docs[1]]))
    assert orchestrated == ["request", "prefill", "decode", "cache"]
    assert by_prefill == ["cache", "repair"]
