"""The engine loop: its step budget (on a fake clock of step times), its thread, work that
fails or is cancelled at every stage while other requests run on, and the async bridges'
bounded pool. Threads are sequenced with gates and counters, never with timing."""

from __future__ import annotations

import asyncio
import threading

import pytest
from rag_prompts import rag_prompt
from test_cancellation import _engine, _prompts

from kvboost_rag import RequestCancelled
from kvboost_rag.cancellation import Cancellation
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.dev.threads import HUNG_SECONDS, loop_held, wait_for
import kvboost_rag.engine_loop.loop as loop_module
from kvboost_rag.engine_loop.budget import MIN_SLICE, PRIOR_TOKENS, ROW_TOKENS_BESIDE_PROMPTS, StepBudget, usual_step
from kvboost_rag.hf.passes import ModelCall
from kvboost_rag.integration.async_stream import MAX_CALL_THREADS, call_in_thread, call_threads


# ---------------------------------------------------------------------- the step budget
def _budget(**settings) -> StepBudget:
    return StepBudget(KVBoostSettings(prefill_chunk_tokens=512, max_decode_wait=1.0, **settings), "cpu")


def test_with_no_row_decoding_a_step_takes_the_whole_chunk_and_on_cuda_a_token_budget():
    assert _budget().prompt_tokens(0, 0) == 512
    cuda = StepBudget(KVBoostSettings(prefill_chunk_tokens=2048), "cuda")
    assert cuda.prompt_tokens(4, 20) == 2028 and cuda.prompt_tokens(0, 0) == 2048
    assert cuda.row_tokens(prompt_waiting=True) is None


def test_beside_rows_a_step_starts_at_the_prior_then_follows_its_target():
    budget = _budget()
    assert budget.prompt_tokens(4, 4) == PRIOR_TOKENS
    for _ in range(3):
        budget.record(4, 0, 0.100)  # the streams' usual step: 100 ms
    budget.record(4, 64, 0.400)  # twice the target (1 + 1.0) x 100 ms: the slice halves
    assert budget.prompt_tokens(4, 4) == 32
    budget.record(4, 32, 0.100)  # far under the target: at most doubled at once
    assert budget.prompt_tokens(4, 4) == 64
    budget.record(4, 64, 0.160)  # 200 / 160 ms
    assert budget.prompt_tokens(4, 4) == 80
    budget.record(4, 10, 0.100)  # its work ran short of the slice: no reason to shrink it
    assert budget.prompt_tokens(4, 4) == 80
    budget.record(4, 10, 0.800)  # even that short slice took far too long: it shrinks
    assert budget.prompt_tokens(4, 4) == MIN_SLICE
    for _ in range(20):
        budget.record(4, 512, 0.150)
    assert budget.prompt_tokens(4, 4) == 512  # never past the chunk


def test_slices_beside_rows_grow_past_the_sizes_measured_dear_against_the_idle_cost():
    """Idle: 512 tokens in 512 ms (1 ms a token). Beside rows whose usual step is 100 ms, a
    32-token slice adding 64 ms costs 2 ms a token (dear): slices start at 64 from then on,
    however small the pause target makes them; a 64-token slice adding 70 ms is fine."""
    budget = _budget()
    for _ in range(3):
        budget.record(4, 0, 0.100)
    assert budget.costs.floor(512) == MIN_SLICE  # nothing measured idle yet
    budget.record(0, 512, 0.512)
    budget.record(4, 32, 0.164)
    assert budget.costs.floor(512) == 64
    budget.record(4, 64, 0.170)
    assert budget.costs.floor(512) == 64  # 64 is efficient: the floor stays
    budget.record(4, 10, 0.800)  # a pause far over its target shrinks the slice...
    assert budget.prompt_tokens(4, 4) == 64  # ...but not below the floor
    budget.record(0, 100, 10.0)  # a short idle step says nothing of the idle cost
    assert budget.costs.floor(512) == 64
    assert budget.costs.floor(48) == 48  # never past the chunk


def test_more_requests_waiting_than_rows_decoding_stretch_the_target():
    alone, burst = _budget(), _budget()
    for budget in (alone, burst):
        for _ in range(3):
            budget.record(2, 0, 0.100)
    alone.record(2, 64, 0.300, requests_waiting=1)  # target 200 ms
    burst.record(2, 64, 0.300, requests_waiting=6)  # target (1 + 6 / 2) x 100 ms = 400 ms
    assert alone.prompt_tokens(2, 2) == 43 and burst.prompt_tokens(2, 2) == 85


def test_the_usual_step_follows_the_rows_decoding():
    assert usual_step([], 4) is None
    line = [(1, 0.10), (2, 0.15), (4, 0.25), (4, 0.25)]  # 50 ms a pass and 50 ms a row
    assert usual_step(line, 8) == pytest.approx(0.45)
    flat = [(2, 0.12), (2, 0.12)]  # one row count: each row more is a third of a step more
    assert usual_step(flat, 2) == pytest.approx(0.12) and usual_step(flat, 5) == pytest.approx(0.24)


def test_rows_run_short_drafts_while_prompt_work_waits_on_a_cpu():
    budget = _budget()
    assert budget.row_tokens(prompt_waiting=True) == ROW_TOKENS_BESIDE_PROMPTS
    assert budget.row_tokens(prompt_waiting=False) is None


# ---------------------------------------------------------------------- the loop's thread
def test_the_loop_runs_on_one_thread_of_its_own_that_is_no_daemon_and_ends_when_idle(make_engine, docs):
    engine = _engine(make_engine, docs)
    threads: list[threading.Thread] = []
    forward = engine._adapter.forward_segments
    engine._adapter.forward_segments = lambda segments: threads.append(threading.current_thread()) or forward(segments)
    engine.generate(_prompts(docs)[0], max_new_tokens=6)
    assert {t.name for t in threads} == {"kvboost-engine"} and not any(t.daemon for t in threads)
    assert threading.current_thread() not in threads
    wait_for(lambda: not engine._loop.active)
    # Started again by a call from a daemon thread (a server's, a warmer's): still no daemon.
    threads.clear()
    caller = threading.Thread(target=engine.generate, args=(_prompts(docs)[1],), kwargs={"max_new_tokens": 2}, daemon=True)
    caller.start()
    caller.join()
    assert threads and {t.name for t in threads} == {"kvboost-engine"} and not any(t.daemon for t in threads)
    wait_for(lambda: not engine._loop.active)


def test_the_loops_thread_hands_the_heaps_free_memory_back_once_as_it_ends(make_engine, docs, monkeypatch):
    engine = _engine(make_engine, docs)
    trims: list[tuple[str, bool]] = []  # (the trimming thread's name, whether it owned the loop)
    loop = engine._loop
    owner = lambda: (threading.current_thread().name, loop._thread is threading.current_thread())  # noqa: E731
    monkeypatch.setattr(loop_module.c_heap, "trim", lambda: trims.append(owner()) or True)
    engine.generate(_prompts(docs)[0], max_new_tokens=6)
    engine.generate(_prompts(docs)[1], max_new_tokens=6)  # the thread may or may not end between the two
    wait_for(lambda: not loop.active)
    # Once per idle end, on the loop's thread while it still owns the loop: no other thread's
    # pass runs beside the trim (a request that came in meanwhile waits for this thread).
    assert trims == [("kvboost-engine", True)] or trims == [("kvboost-engine", True)] * 2
    count = len(trims)
    engine.generate(_prompts(docs)[2], max_new_tokens=2)
    wait_for(lambda: not engine._loop.active)
    assert len(trims) == count + 1


def test_a_request_that_comes_in_during_the_trim_runs_on_the_same_thread(make_engine, docs, monkeypatch):
    engine = _engine(make_engine, docs)
    loop, results, threads = engine._loop, [], []
    callers: list[threading.Thread] = []

    def trim_while_a_request_comes_in() -> bool:
        threads.append(threading.current_thread())
        if not callers:  # the first trim: a request arrives before it returns
            call = lambda: results.append(engine.generate(_prompts(docs)[1], max_new_tokens=2))  # noqa: E731
            caller = threading.Thread(target=call)
            caller.start()
            callers.append(caller)  # once started: the test joins it
            wait_for(lambda: loop._incoming)
        return True

    monkeypatch.setattr(loop_module.c_heap, "trim", trim_while_a_request_comes_in)
    engine.generate(_prompts(docs)[0], max_new_tokens=2)
    wait_for(lambda: callers)
    callers[0].join(HUNG_SECONDS)
    assert not callers[0].is_alive() and len(results) == 1  # answered, not left in a queue nobody reads
    wait_for(lambda: not loop.active)
    assert len(threads) == 2 and threads[0] is threads[1]  # the thread that trimmed ran it, then trimmed again


def test_work_submitted_from_the_loops_own_thread_is_refused(make_engine):
    engine = make_engine("llama")
    loop, seen = engine._loop, []

    def inner():
        yield ModelCall(lambda: None)

    def outer():
        try:
            loop.submit(inner())
        except RuntimeError as error:
            seen.append(error)
        yield ModelCall(lambda: None)

    loop.run(outer())
    assert seen and "own thread" in str(seen[0])


def test_a_work_that_fails_in_its_host_work_fails_alone(make_engine, docs):
    engine = _engine(make_engine, docs)
    reference = engine.generate(_prompts(docs)[1], max_new_tokens=8, reuse=False)

    def broken():
        yield ModelCall(lambda: None)
        raise ValueError("host work failed")

    with loop_held(engine):
        failing = engine._loop.submit(broken())
        results: list = []
        thread = threading.Thread(target=lambda: results.append(engine.generate(_prompts(docs)[1], max_new_tokens=8, reuse=False)))
        thread.start()
        wait_for(lambda: engine._loop.queued == 2)
    thread.join(HUNG_SECONDS)
    with pytest.raises(ValueError, match="host work failed"):
        failing.result(HUNG_SECONDS)
    assert results[0].token_ids == reference.token_ids


def test_cancelling_work_queued_behind_the_loop_ends_it_at_once():
    """Its future ends while the loop is still held: the work never touched the model."""
    from kvboost_rag.engine_loop import BatchPlaces, EngineLoop
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
    from kvboost_rag.hf import ModelAdapter

    adapter = ModelAdapter(tiny_model("llama"), tiny_tokenizer())
    loop = EngineLoop(adapter, KVBoostSettings(), BatchPlaces(KVBoostSettings()))
    release, ran = threading.Event(), []

    def holding():
        yield ModelCall(lambda: release.wait(HUNG_SECONDS))

    def queued():
        ran.append(1)
        yield ModelCall(lambda: None)

    held = loop.submit(holding())
    wait_for(lambda: loop.queued == 0)
    cancellation = Cancellation()
    future = loop.submit(queued(), cancellation)
    cancellation.cancel()
    with pytest.raises(RequestCancelled):
        future.result(HUNG_SECONDS)  # at once: the loop is still held
    release.set()
    held.result(HUNG_SECONDS)
    assert ran == []


@pytest.mark.parametrize("stage", ["queued", 1, 2, 3, 5, 8, 13, 21, 34, "first step"])
def test_a_request_cancelled_at_any_stage_leaves_every_other_request_running(make_engine, docs, stage):
    """Several requests decode and prefill together; one of them is cancelled at a given
    moment (before its work reaches the loop, after the loop's n-th pass: its work queued
    behind the others, between two slices of its prefill, in the middle of its decoding;
    right after its first token): it ends, nothing it held stays held, and the others give
    their answers alone."""
    prompts = _prompts(docs)
    reference = [_engine(make_engine, docs).generate(p, max_new_tokens=12) for p in prompts[:3]]
    engine = _engine(make_engine, docs, prefill_chunk_tokens=16)
    victim_prompt = rag_prompt([docs[2], docs[3]], "Cancelled question?")
    victim = engine.stream(victim_prompt, max_new_tokens=40, reuse=False)  # many slices of prefill
    passes, cut = [], stage if isinstance(stage, int) else None
    forward = engine._adapter.forward_segments

    def counting(segments):
        passes.append(len(segments))
        if cut is not None and len(passes) == cut:
            victim.cancellation.cancel()  # from the loop's thread, between two of its steps
        return forward(segments)

    engine._adapter.forward_segments = counting
    results: list = [None] * 3
    stayers = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(prompts[i], max_new_tokens=12))) for i in range(3)]
    pieces: list[str] = []
    if stage == "queued":
        victim.cancellation.cancel()
    for thread in stayers:
        thread.start()
    for piece in victim:
        pieces.append(piece)
        if stage == "first step":
            victim.close()
    for thread in stayers:
        thread.join(HUNG_SECONDS)
    assert victim.result is None and (stage != "queued" or pieces == [])
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    wait_for(lambda: engine._places.admitted == 0 and not engine._loop.active)
    assert engine._loop.waiting == 0 and engine._loop.queued == 0


# ---------------------------------------------------------------------- the async bridges
def test_the_async_bridges_run_on_a_bounded_pool_of_reused_threads():
    # More calls than the pool has threads, one after another: a thread per call would give as
    # many distinct threads as calls (the list keeps each alive, so none is mistaken for another).
    async def calls() -> list[threading.Thread]:
        return [await call_in_thread(threading.current_thread) for _ in range(MAX_CALL_THREADS + 40)]

    threads = asyncio.run(calls())
    assert all(thread.name.startswith("kvboost-call") for thread in threads)
    assert len({id(thread) for thread in threads}) <= MAX_CALL_THREADS
    assert call_threads()._max_workers == MAX_CALL_THREADS
