"""The one surface benchmarks read the engine's internals through reaches the live parts."""

from __future__ import annotations

from rag_prompts import rag_prompt

from kvboost_rag.dev.internals import internals


def test_the_benches_surface_reaches_the_engines_parts(make_engine, docs):
    engine = make_engine("llama")
    engine.warm_documents(docs[:2])
    engine.flush()
    parts = internals(engine)
    assert [tier.name for tier in parts.tiers][0] == "memory"
    assert parts.cache.index.document_count == 2
    plan = parts.planner.plan(parts.tokenizing.prompt(rag_prompt(docs[1::-1])))
    assert len(plan.documents) == 2  # both warmed documents found in a prompt of its own
    assert parts.adapter.num_layers == engine.model.config.num_hidden_layers
    live = parts.cache.memory_account(type(engine.cache_stats().memory)())
    assert live.staged_entries == 0
