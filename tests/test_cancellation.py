"""A cancelled request stops at every stage: waiting for a place, its prompt work waiting in the
engine loop's queue (at once), in its prefill (at the next step boundary), decoding (at the
next step, its reader at once); its place and buffers go back, nothing leaks across many, and
the others' greedy outputs are unchanged. Threads are sequenced with gates and counters, never
with timing."""

from __future__ import annotations

import asyncio
import threading

import pytest
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost, RequestCancelled
from kvboost_rag.integration.async_stream import call_in_thread, iterate_in_thread
from kvboost_rag.dev.threads import HUNG_SECONDS, wait_for




def _engine(make_engine, docs, **settings) -> KVBoost:
    engine = make_engine("llama", **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    return engine


def _prompts(docs: list[str]) -> list[str]:
    return [rag_prompt([docs[i % 4], docs[(i + 1) % 4]], f"Question {i}?") for i in range(6)]


class Ledger:
    """Every host buffer lease the engine takes, to check they all went back."""

    def __init__(self, engine: KVBoost) -> None:
        self.leases: list = []
        pool = engine._requests.memory.host_buffers
        lease = pool.lease
        pool.lease = lambda capacity: self.leases.append(lease(capacity)) or self.leases[-1]

    def all_back(self) -> bool:
        return all(lease.released for lease in self.leases)


class GatedSteps:
    """Steps that decode wait for :meth:`open` (a request stays decoding as long as the test
    wants; the loop waits there, so work queued behind stays queued)."""

    def __init__(self, engine: KVBoost) -> None:
        self.gate = threading.Event()
        self.waiting = 0
        loop, forward = engine._loop, engine._adapter.forward_segments

        def gated(segments):
            if loop._running:  # a step with decode rows (the loop's own state, on its thread)
                self.waiting += 1
                self.gate.wait(HUNG_SECONDS)
            return forward(segments)

        engine._adapter.forward_segments = gated

    def open(self) -> None:
        self.gate.set()


class Consumer(threading.Thread):
    """Iterates a stream in a thread of its own."""

    def __init__(self, stream, take: int | None = None) -> None:
        super().__init__()
        self.stream, self.take, self.pieces, self.error = stream, take, [], None
        self.took = threading.Event()

    def run(self) -> None:
        try:
            for piece in self.stream:
                self.pieces.append(piece)
                if self.take is not None and len(self.pieces) == self.take:
                    self.took.set()
        except Exception as error:  # noqa: BLE001 - checked by the test
            self.error = error
        finally:
            self.took.set()  # also when the stream ended with fewer pieces


def _assert_nothing_held(engine: KVBoost, ledger: Ledger) -> None:
    wait_for(lambda: engine._places.admitted == 0)
    wait_for(ledger.all_back)
    wait_for(lambda: not engine._loop.active)  # the loop's thread ends once nothing is left
    assert engine._loop.waiting == 0


def test_closing_a_stream_that_waits_for_a_place_takes_it_out_of_the_line(make_engine, docs):
    engine = _engine(make_engine, docs, max_batch_size=1)
    ledger, steps = Ledger(engine), GatedSteps(engine)
    first = engine.stream(_prompts(docs)[0], max_new_tokens=50)
    next(first)  # decoding (its steps held at the gate): it holds the only place
    second = engine.stream(_prompts(docs)[1], max_new_tokens=8)
    consumer = Consumer(second)
    consumer.start()
    wait_for(lambda: engine._loop.waiting == 1)
    second.close()  # from another thread than the one inside next()
    consumer.join(HUNG_SECONDS)
    assert not consumer.is_alive() and consumer.pieces == [] and consumer.error is None
    assert second.result is None and engine._loop.waiting == 0
    first.close()
    steps.open()
    _assert_nothing_held(engine, ledger)


def test_closing_a_stream_whose_work_waits_in_the_loop_ends_it_at_once_before_its_prefill(make_engine, docs):
    engine = _engine(make_engine, docs)
    ledger, steps = Ledger(engine), GatedSteps(engine)
    holder = engine.stream(_prompts(docs)[1], max_new_tokens=50)
    next(holder)  # decoding: the loop waits at the gate in its next step
    wait_for(lambda: steps.waiting == 1)
    looked_up = []
    lookup = engine._requests.prefiller.lookup
    engine._requests.prefiller.lookup = lambda *a, **k: looked_up.append(1) or lookup(*a, **k)
    stream = engine.stream(_prompts(docs)[0], max_new_tokens=8)
    consumer = Consumer(stream)
    consumer.start()
    wait_for(lambda: looked_up == [1])  # its work is about to queue behind the held step
    stream.close()
    consumer.join(HUNG_SECONDS)  # it left though the loop is still held
    assert not consumer.is_alive() and consumer.pieces == [] and consumer.error is None
    assert stream.result is None
    holder.close()
    steps.open()
    _assert_nothing_held(engine, ledger)


def test_a_cancelled_prefill_stops_at_its_next_step_boundary(make_engine, docs):
    engine = _engine(make_engine, docs, prefill_chunk_tokens=16)
    ledger = Ledger(engine)
    passes = []
    forward = engine._adapter.forward_segments
    stream = engine.stream(_prompts(docs)[2], max_new_tokens=8, reuse=False)  # full prefill: many slices

    def counting(segments):
        passes.append(1)
        if len(passes) == 3:
            stream.cancellation.cancel()  # as a client leaving does, from its own thread
        return forward(segments)

    engine._adapter.forward_segments = counting
    assert list(stream) == [] and stream.result is None
    cancelled_at = len(passes)
    engine._adapter.forward_segments = forward
    full = engine.generate(_prompts(docs)[2], max_new_tokens=1, reuse=False)
    assert full.prompt_tokens > 4 * 16
    assert cancelled_at == 3  # it stopped at the boundary after the pass during which it was cancelled
    _assert_nothing_held(engine, ledger)


def test_closing_a_decoding_stream_frees_its_reader_at_once_and_its_sequence_at_the_next_step(make_engine, docs):
    engine = _engine(make_engine, docs)
    ledger, steps = Ledger(engine), GatedSteps(engine)
    stream = engine.stream(_prompts(docs)[3], max_new_tokens=40)
    consumer = Consumer(stream)
    consumer.start()
    wait_for(lambda: steps.waiting == 1)  # prefilled; its reader waits for a step held at the gate
    stream.close()
    consumer.join(HUNG_SECONDS)  # its reader left though the step still waits
    assert not consumer.is_alive() and consumer.error is None and stream.result is None
    assert engine._places.admitted == 1  # its sequence leaves at the next step
    steps.open()
    _assert_nothing_held(engine, ledger)


def test_many_clients_leaving_at_every_stage_leak_nothing_and_change_no_answer(make_engine, docs):
    prompts = _prompts(docs)
    reference = [_engine(make_engine, docs).generate(p, max_new_tokens=12) for p in prompts[:3]]
    engine = _engine(make_engine, docs, prefill_chunk_tokens=16)
    ledger = Ledger(engine)
    results: list = [None] * 3

    def stay(i: int) -> None:
        results[i] = engine.generate(prompts[i], max_new_tokens=12)

    stayers = [threading.Thread(target=stay, args=(i,)) for i in range(3)]
    for thread in stayers:
        thread.start()
    for round_ in range(8):
        leavers = [engine.stream(prompts[(round_ + k) % 6], max_new_tokens=30) for k in range(4)]
        leavers[0].close()  # before it started
        consumers = [Consumer(s, take=take) for s, take in zip(leavers[1:], (1, 3, None))]
        for consumer in consumers:
            consumer.start()
        consumers[0].took.wait(HUNG_SECONDS)
        consumers[1].took.wait(HUNG_SECONDS)
        for stream in leavers[1:]:  # after a piece, after three, and wherever the third one is
            stream.close()
        for consumer in consumers:
            consumer.join(HUNG_SECONDS)
            assert not consumer.is_alive() and consumer.error is None
    for thread in stayers:
        thread.join(HUNG_SECONDS)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    _assert_nothing_held(engine, ledger)
    assert len(ledger.leases) >= 3 + 8 * 2 and engine._requests.memory.host_buffers.segments == 1


def test_cancelling_the_awaiting_task_cancels_the_engine_call(make_engine, docs):
    engine = _engine(make_engine, docs, max_batch_size=1)
    ledger, steps = Ledger(engine), GatedSteps(engine)
    holder = engine.stream(_prompts(docs)[0], max_new_tokens=50)
    next(holder)  # holds the only place while its steps wait at the gate
    ended: list[object] = []

    def call() -> None:
        try:
            ended.append(engine.generate(_prompts(docs)[1], max_new_tokens=8))
        except RequestCancelled as error:
            ended.append(error)

    async def cancel_while_queued() -> None:
        task = asyncio.ensure_future(call_in_thread(call))
        await asyncio.to_thread(wait_for, lambda: engine._loop.waiting == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_queued())
    wait_for(lambda: bool(ended))
    assert isinstance(ended[0], RequestCancelled)
    holder.close()
    steps.open()
    _assert_nothing_held(engine, ledger)


def test_leaving_an_async_iteration_cancels_the_stream_it_waits_on(make_engine, docs):
    engine = _engine(make_engine, docs)
    ledger, steps = Ledger(engine), GatedSteps(engine)
    streams = []

    def start():
        streams.append(engine.stream(_prompts(docs)[4], max_new_tokens=40))
        return iter(streams[0])

    async def take_one_and_leave() -> list[str]:
        items = iterate_in_thread(start)
        first = [await items.__anext__()]
        await asyncio.to_thread(wait_for, lambda: steps.waiting == 1)  # the worker waits on a held step
        await items.aclose()  # returns though that step is still held
        return first

    assert len(asyncio.run(take_one_and_leave())) == 1
    assert streams[0].cancellation.cancelled and streams[0].result is None
    steps.open()
    _assert_nothing_held(engine, ledger)
