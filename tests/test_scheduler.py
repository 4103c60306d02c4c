"""Continuous batching: concurrent generate/stream calls share the engine loop's steps."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.dev.threads import wait_for
from kvboost_rag.engine_loop import BatchPlaces
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.prefill.prefiller import SPARE_ROWS
from loop_hooks import record_decode_sizes


def _prompts(docs: list[str]) -> list[str]:
    return [rag_prompt([docs[i % 4], docs[(i + 1) % 4]], f"Question {i}?") for i in range(6)]


def _engine(make_engine, docs, **settings) -> KVBoost:
    engine = make_engine("llama", **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    return engine


def _reference(make_engine, docs, prompts, **options) -> list:
    """Each prompt alone on an engine in the same starting state."""
    return [_engine(make_engine, docs).generate(p, **options) for p in prompts]


def _record_steps(engine: KVBoost) -> list[int]:
    return record_decode_sizes(engine)


def _concurrently(fn, items) -> list:
    barrier = threading.Barrier(len(items))

    def run(item):
        barrier.wait()
        try:
            return fn(item)
        except Exception as error:  # noqa: BLE001 - compared by the test
            return error

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(run, items))


def test_concurrent_generates_share_steps_and_match_sequential_outputs(make_engine, docs):
    prompts = _prompts(docs)
    reference = _reference(make_engine, docs, prompts, max_new_tokens=24)
    engine = _engine(make_engine, docs)
    sizes = _record_steps(engine)
    results = _concurrently(lambda p: engine.generate(p, max_new_tokens=24), prompts)
    for ref, result in zip(reference, results):
        assert result.token_ids == ref.token_ids and result.output_text == ref.output_text
        assert result.prompt_tokens == ref.prompt_tokens
    assert max(sizes) > 1, "concurrent requests never shared a decode step"
    # Every token after the first came from one shared step (as its own token or an accepted
    # draft): no step ran a request twice.
    assert sum(sizes) == sum(r.generated_tokens - 1 - r.drafted_tokens + (r.finish_reason == "eos") for r in results)
    assert engine._places.admitted == 0


def test_concurrent_streams_yield_per_request(make_engine, docs):
    prompts = _prompts(docs)[:4]
    reference = _reference(make_engine, docs, prompts, max_new_tokens=16)
    engine = _engine(make_engine, docs)

    def stream(prompt):
        s = engine.stream(prompt, max_new_tokens=16)
        pieces = list(s)
        return pieces, s.result

    outputs = _concurrently(stream, prompts)
    for ref, (pieces, result) in zip(reference, outputs):
        assert "".join(pieces) == ref.output_text == result.output_text
        assert result.token_ids == ref.token_ids


def test_batch_size_cap_is_respected(make_engine, docs):
    prompts = _prompts(docs)
    reference = _reference(make_engine, docs, prompts, max_new_tokens=10)
    engine = _engine(make_engine, docs, max_batch_size=2)
    sizes = _record_steps(engine)
    results = engine.generate_batch(prompts, max_new_tokens=10)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert max(sizes) == 2
    threaded = _concurrently(lambda p: engine.generate(p, max_new_tokens=10), prompts)
    assert [r.token_ids for r in threaded] == [r.token_ids for r in reference]
    assert max(sizes) == 2 and engine._loop.peak_batch == 2


def test_cache_memory_cap_is_respected(make_engine, docs):
    prompts = _prompts(docs)[:3]
    engine = _engine(make_engine, docs)
    # Room for the K/V buffers of one of these prompts, not two.
    one = max(engine._requests.memory.reserved_bytes(len(engine.tokenizer(p)["input_ids"]) + 8 + SPARE_ROWS) for p in prompts)
    engine.settings.max_batch_cache_bytes = one + one // 2
    sizes = _record_steps(engine)
    results = engine.generate_batch(prompts, max_new_tokens=8)
    assert all(r.generated_tokens > 0 for r in results)
    assert max(sizes) == 1
    engine.settings.max_batch_cache_bytes = 3 * one
    sizes.clear()
    engine.generate_batch(prompts, max_new_tokens=8)
    assert max(sizes) == 3


def test_admission_is_first_come_first_served(make_engine, docs):
    """With one place, four requests queued one after another while a stream holds it hold no
    buffers while they wait, and are admitted in the order they came (each reaches its first
    token only once admitted)."""
    engine = _engine(make_engine, docs, max_batch_size=1)
    prompts = _prompts(docs)
    holder = engine.stream(prompts[0], max_new_tokens=200)
    next(holder)
    pool = engine._requests.memory.host_buffers
    holders_bytes = pool.lent_bytes
    order: list[int] = []
    streams = [engine.stream(prompts[1 + i], max_new_tokens=200) for i in range(4)]

    def first_token(i: int) -> None:
        next(streams[i])
        order.append(i)
        streams[i].close()  # its place goes back: the next in line is admitted

    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=first_token, args=(i,), daemon=True))
        threads[-1].start()
        wait_for(lambda: engine._loop.waiting == i + 1)  # it waits before the next arrives
    assert order == [] and engine._places.admitted == 1 and pool.lent_bytes == holders_bytes
    holder.close()
    for thread in threads:
        thread.join(60)
    assert order == [0, 1, 2, 3]
    wait_for(lambda: engine._places.admitted == 0 and engine._loop.waiting == 0)


def test_places_refuse_past_their_bounds_and_tell_listeners_of_room():
    places = BatchPlaces(KVBoostSettings(max_batch_size=2, max_batch_cache_bytes=100))
    told: list[int] = []
    places.listen(lambda: told.append(places.admitted))
    big = places.try_reserve(1000)  # alone: admitted however large
    assert big is not None and places.try_reserve(1) is None  # past the bytes
    places.release(big)
    assert told == [0]
    first, second = places.try_reserve(40), places.try_reserve(40)
    assert first is not None and second is not None
    assert places.try_reserve(1) is None  # past the places
    places.release(first)  # the refusals took nothing: one place and 40 bytes held
    assert places.admitted == 1 and places.held_bytes == 40 and places.try_reserve(40) is not None


def test_a_failing_request_does_not_break_the_others(make_engine, docs):
    prompts = _prompts(docs)[:4]
    reference = _reference(make_engine, docs, prompts, max_new_tokens=12)
    engine = _engine(make_engine, docs)
    calls = [*prompts[:2], "", prompts[2], "x\ud800", prompts[3]]
    results = _concurrently(lambda p: engine.generate(p, max_new_tokens=12), calls)
    assert isinstance(results[2], InvalidInputError) and isinstance(results[4], InvalidInputError)
    good = [r for r in results if not isinstance(r, Exception)]
    assert [r.token_ids for r in good] == [r.token_ids for r in reference]
    assert engine._places.admitted == 0


def test_a_failing_row_fails_its_request_alone_and_the_engine_goes_on(make_engine, docs):
    """A pass that fails is run again row by row: the row that fails again ends its own
    request only; the others' answers are their answers alone."""
    prompts = _prompts(docs)[:3]
    full = [_engine(make_engine, docs).generate(p, max_new_tokens=6, reuse=False) for p in prompts]
    engine = _engine(make_engine, docs)
    real, poisoned = engine._adapter.forward_segments, []

    def forward(segments):
        rows = [s for s in segments if s.logits == len(s)]
        if not poisoned and len(rows) > 1:
            poisoned.append(rows[1].cache)
        if any(s.cache is c for s in segments for c in poisoned):
            raise RuntimeError("the model failed")
        return real(segments)

    engine._adapter.forward_segments = forward
    results = engine.generate_batch(prompts, max_new_tokens=6, reuse=False)
    failed = [r for r in results if isinstance(r, RuntimeError)]
    assert len(failed) == 1 and poisoned
    assert [r.token_ids for r, f in zip(results, full) if not isinstance(r, Exception)] == [
        f.token_ids for r, f in zip(results, full) if not isinstance(r, Exception)
    ]
    assert engine._places.admitted == 0
    engine._adapter.forward_segments = real
    again = engine.generate_batch(prompts, max_new_tokens=6, reuse=False)
    assert [r.token_ids for r in again] == [r.token_ids for r in full]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dying_loop_fails_its_requests_instead_of_leaving_them_waiting(make_engine, docs):
    class Stop(BaseException):
        pass

    prompts = _prompts(docs)[:3]
    engine = _engine(make_engine, docs)
    loop = engine._loop
    finish = loop._finish_rows

    def dying(rows, outputs):
        loop._finish_rows = finish  # the next loop thread steps normally
        raise Stop()

    loop._finish_rows = dying
    with pytest.raises(Stop):
        engine.generate_batch(prompts, max_new_tokens=6, reuse=False)
    wait_for(lambda: not loop.active)
    assert engine._places.admitted == 0
    again = engine.generate_batch(prompts, max_new_tokens=6, reuse=False)
    assert all(r.generated_tokens == 6 for r in again)


def test_closing_a_stream_gives_its_place_back(make_engine, docs):
    engine = _engine(make_engine, docs, max_batch_size=1)
    stream = engine.stream(_prompts(docs)[0], max_new_tokens=200)
    next(stream)
    assert engine._places.admitted == 1
    stream.close()
    result = engine.generate(_prompts(docs)[1], max_new_tokens=4)  # would wait forever on a leaked place
    assert result.generated_tokens == 4
    assert stream.result is None


@pytest.mark.asyncio
async def test_async_callers_share_steps(make_engine, docs):
    import asyncio

    prompts = _prompts(docs)[:4]
    reference = _reference(make_engine, docs, prompts, max_new_tokens=16)
    engine = _engine(make_engine, docs)
    sizes = _record_steps(engine)
    results = await asyncio.gather(*(asyncio.to_thread(engine.generate, p, max_new_tokens=16) for p in prompts))
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert max(sizes) > 1


