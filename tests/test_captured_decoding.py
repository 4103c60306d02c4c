"""The engine decoding through captured steps: requests prefill into slots of the static K/V
pool and decode there, drafts included; the tokens are the eager path's, and every slot goes
back to the pool once both its decoding and its request's write-back are done.

On the CPU the steps compile with ``aot_eager`` here (``inductor`` is what CUDA runs; its CPU
compile takes about a minute a bucket) and three token buckets keep the build short.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from devices import CUDA
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from test_draft_decoding import OracleDrafter, assert_same_greedy

import kvboost_rag.engine as engine_module
from kvboost_rag import KVBoost
from kvboost_rag.decode.draft_policy import DraftPolicy
from kvboost_rag.generation import request_work
from kvboost_rag.generation.slots import SlotLease
from kvboost_rag.hf.captured import SlotPool, build_captured_rows

SETTINGS = dict(
    show_progress=False, chunk_size=32, captured_pool_bytes=32 * 2**20, captured_token_buckets=(1, 4, 16),
    captured_build="at_load",
)


@pytest.fixture(scope="module")
def engines(tokenizer):
    """``family -> (captured engine, eager engine)``, built once per module."""
    from kvboost_rag.dev.testing import tiny_model

    patch = pytest.MonkeyPatch()
    patch.setattr(engine_module, "build_captured_rows", functools.partial(build_captured_rows, backend="aot_eager"))
    built = {}
    for family in ("llama", "gemma2"):
        captured = KVBoost.from_model(tiny_model(family), tokenizer, captured_steps="on", **SETTINGS)
        eager = KVBoost.from_model(tiny_model(family), tokenizer, **SETTINGS)
        assert captured.captured_steps_run == 0 and eager.captured_steps_run is None
        built[family] = (captured, eager)
    patch.undo()
    return built


def _pool(engine: KVBoost) -> SlotPool:
    return engine._captured.pool


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_captured_decoding_gives_the_eager_tokens_with_drafts_alone_and_batched(engines, docs, family, monkeypatch):
    captured, eager = engines[family]
    for engine in (captured, eager):
        engine.warm(SYSTEM_PROMPT)
        engine.warm_documents(docs[:3])
    prompts = [rag_prompt([docs[0], docs[1]]), rag_prompt([docs[2]], "Summarize."), SYSTEM_PROMPT + "\n\nQuestion: hi?\nAnswer:"]
    references = [eager.generate(p, max_new_tokens=24, return_logits=True) for p in prompts]
    answers = {p: r.token_ids for p, r in zip(prompts, references)}
    monkeypatch.setattr(request_work, "drafter_for", lambda plan: OracleDrafter(answers.get(plan.tokens.text, []), 1024))
    monkeypatch.setattr(DraftPolicy, "length", lambda self, s, source, match, available, rows: min(available, self.max_tokens))
    slots = _pool(captured).free_slots
    runs = captured.captured_steps_run
    alone = [captured.generate(p, max_new_tokens=24) for p in prompts]
    batched = captured.generate_batch(prompts, max_new_tokens=24)
    assert captured.captured_steps_run > runs, "the steps did not run captured"
    for reference, one, batch in zip(references, alone, batched):
        for run in (one, batch):
            assert_same_greedy(run.token_ids, reference.token_ids, reference.step_logits)
            assert run.drafted_tokens > 0
    assert _pool(captured).free_slots == slots, "a slot was not given back"


def test_a_slot_outlives_neither_decoding_nor_the_write_back(engines, docs):
    captured, eager = engines["llama"]
    pool = _pool(captured)
    free = pool.free_slots
    pair = [docs[3], docs[4]]
    stream = captured.stream(rag_prompt(pair), max_new_tokens=20, documents=pair)
    next(stream)
    assert pool.free_slots == free - 1
    stream.close()  # closed early: the write-back runs, and the worker lets it go at its next step
    deadline = time.monotonic() + 60
    while pool.free_slots != free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.free_slots == free
    # What the write-back cut from the slot is the prompt's K/V: a later prompt holding those
    # documents reads them and decodes as on the eager engine, which stored its own.
    eager.generate(rag_prompt(pair), max_new_tokens=4, documents=pair)
    second = rag_prompt(pair[::-1], "Which one?")
    a = captured.generate(second, max_new_tokens=12, documents=pair)
    b = eager.generate(second, max_new_tokens=12, documents=pair)
    assert a.content_hit_tokens == b.content_hit_tokens > 0
    assert a.token_ids == b.token_ids


def test_a_request_that_finds_no_free_slot_decodes_eagerly(engines, docs):
    captured, eager = engines["llama"]
    pool = _pool(captured)
    taken = []
    while (slot := pool.acquire(1)) is not None:
        taken.append(slot)
    try:
        prompt = rag_prompt([docs[5]])
        assert captured.generate(prompt, max_new_tokens=10).token_ids == eager.generate(prompt, max_new_tokens=10).token_ids
    finally:
        for slot in taken:
            pool.release(slot)


def test_a_lease_returns_its_slot_when_both_holders_released_it():
    pool = SlotPool.planned(_Layout(), torch.float32, "cpu", 4 * 2**20, 4096, 16)
    lease = SlotLease.take(pool, 100)
    free = pool.free_slots
    lease.release("decode")
    lease.release("decode")  # again: nothing
    assert pool.free_slots == free and not lease.released
    lease.release("request")
    assert pool.free_slots == free + 1 and lease.released
    with pytest.raises(ValueError):
        SlotLease.take(pool, 100).buffers(10**6)


class _Layout:
    layers, kv_heads, head_dim = 2, 2, 16


@pytest.mark.parametrize("device", [CUDA])
def test_on_cuda_captured_graphs_decode_the_eager_tokens(tokenizer, docs, device, monkeypatch):
    """The engine as it runs on a GPU: inductor and CUDA graphs (captured_steps auto)."""
    from kvboost_rag.dev.testing import tiny_model

    settings = {**SETTINGS, "device": device}
    captured = KVBoost.from_model(tiny_model("llama"), tokenizer, **settings)
    eager = KVBoost.from_model(tiny_model("llama"), tokenizer, **settings, captured_steps="off")
    assert captured.captured_steps_run == 0, "captured steps are on by default on CUDA"
    prompts = [rag_prompt([docs[0], docs[1]]), rag_prompt([docs[2]], "Summarize.")]
    references = [eager.generate(p, max_new_tokens=24, return_logits=True) for p in prompts]
    answers = {p: r.token_ids for p, r in zip(prompts, references)}
    monkeypatch.setattr(request_work, "drafter_for", lambda plan: OracleDrafter(answers.get(plan.tokens.text, []), 1024))
    monkeypatch.setattr(DraftPolicy, "length", lambda self, s, source, match, available, rows: min(available, self.max_tokens))
    runs = captured.captured_steps_run
    for results in ([captured.generate(p, max_new_tokens=24) for p in prompts], captured.generate_batch(prompts, max_new_tokens=24)):
        for reference, run in zip(references, results):
            assert_same_greedy(run.token_ids, reference.token_ids, reference.step_logits)
    assert captured.captured_steps_run > runs
    assert _pool(captured).free_slots == len(_pool(captured).slots)
