"""Faults that belong to one request stay with it (issue 73): a fault injected into one
request's drafts, grammar, slice preparation, cache length, release or cleanup, among 11 other
concurrent requests, fails that request alone with its own error while the others' token ids
equal their one-at-a-time answers; a fault of the loop itself settles every future and reader
even when a cleanup raises; ``cache_stats`` and the exit flush are bounded under a wedged tier;
a forked child answers. Threads are sequenced with gates, barriers and counters; time bounds
only end a test that would otherwise hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from rag_prompts import rag_prompt
from test_cancellation import Ledger, _engine

from kvboost_rag import KVBoost, RequestCancelled
from kvboost_rag.cache.manager import STATS_FLUSH_SECONDS
from kvboost_rag.cancellation import Cancellation, cancelling
from kvboost_rag.decode import constrained
from kvboost_rag.decode.drafting import Drafter, Proposal
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.dev.threads import HUNG_SECONDS, loop_held, wait_for
from kvboost_rag.engine_loop import Admission
from kvboost_rag.hf.caches import BufferedCache
from kvboost_rag.hf.passes import ModelCall, TokenPass
from kvboost_rag.integration.async_stream import call_in_thread

#: Requests that run beside the one a fault is injected into (the issue's target).
OTHERS = 11
#: Tokens the other requests generate; the victim asks for one more (that is how the loop's
#: thread tells it apart where a fault needs to).
TOKENS = 10
VICTIM_TOKENS = TOKENS + 1


class InjectedFault(Exception):
    """A failure injected into one request."""


def _prompts(docs: list[str]) -> list[str]:
    return [rag_prompt([docs[i % 4], docs[(i + 1) % 4]], f"Question number {i}?") for i in range(OTHERS)]


def _victim_prompt(docs: list[str]) -> str:
    return rag_prompt([docs[2], docs[3]], "The question whose request fails?")


def _alone(engine: KVBoost, prompts: list[str], **options: Any) -> list[list[int]]:
    """Each prompt's answer, one at a time (full prefill: no answer depends on the cache)."""
    return [engine.generate(p, max_new_tokens=TOKENS, reuse=False, **options).token_ids for p in prompts]


def _together(engine: KVBoost, prompts: list[str], victim: Callable[[], Any]) -> tuple[list[Any], Any]:
    """The prompts' answers and ``victim()``'s outcome, all started at once, each on a thread
    of its own (the victim's is named ``"victim"``); an exception is an outcome."""
    outcomes: list[Any] = [None] * (len(prompts) + 1)
    barrier = threading.Barrier(len(prompts) + 1)

    def run(index: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            outcomes[index] = call()
        except Exception as error:  # noqa: BLE001 - compared by the test
            outcomes[index] = error

    calls = [lambda p=p: engine.generate(p, max_new_tokens=TOKENS, reuse=False) for p in prompts]
    threads = [threading.Thread(target=run, args=(i, c), name=f"request-{i}") for i, c in enumerate(calls)]
    threads.append(threading.Thread(target=run, args=(len(prompts), victim), name="victim"))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HUNG_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a request never ended"
    return outcomes[:-1], outcomes[-1]


def _assert_alone_and_settled(engine: KVBoost, others: list[Any], reference: list[list[int]], ledger: Ledger) -> None:
    """The others answered as alone; nothing any request held is still held."""
    assert [getattr(o, "token_ids", o) for o in others] == reference
    wait_for(lambda: engine._places.admitted == 0 and not engine._loop.active)
    assert engine._places.held_bytes == 0 and engine._loop.queued == 0 and ledger.all_back()


def _victim_generate(engine: KVBoost, docs: list[str], **options: Any) -> Callable[[], Any]:
    return lambda: engine.generate(_victim_prompt(docs), max_new_tokens=VICTIM_TOKENS, reuse=False, **options)


# ---------------------------------------------------------------------- one request's faults
def test_a_drafter_that_fails_to_build_fails_its_request_alone(make_engine, docs, monkeypatch):
    engine = _engine(make_engine, docs)
    prompts = _prompts(docs)
    reference = _alone(engine, prompts)
    built: list[int] = []
    real = DecodeSequence.propose

    def broken_drafter() -> Drafter:
        built.append(1)
        raise InjectedFault("the drafter could not be built")

    def propose(sequence: DecodeSequence):
        if sequence.options.max_new_tokens == VICTIM_TOKENS and sequence._drafter is None:
            sequence.make_drafter = broken_drafter  # built lazily, at its first proposal
        return real(sequence)

    monkeypatch.setattr(DecodeSequence, "propose", propose)
    ledger = Ledger(engine)
    others, victim = _together(engine, prompts, _victim_generate(engine, docs))
    assert isinstance(victim, InjectedFault) and "drafter" in str(victim) and built
    _assert_alone_and_settled(engine, others, reference, ledger)


def test_a_grammar_whose_draft_check_fails_fails_its_request_alone(make_engine, docs, monkeypatch):
    """Every row gets a one-token draft where its texts hold none (greedy keeps its tokens),
    so the victim's constraint is asked about a draft at its first step."""
    engine = _engine(make_engine, docs)
    prompts = _prompts(docs)
    real_propose = Drafter.propose
    monkeypatch.setattr(
        Drafter, "propose", lambda self, limit: real_propose(self, limit) or (Proposal([0], 2, "document") if limit >= 1 else None)
    )
    reference = _alone(engine, prompts)
    checked: list[int] = []

    def valid_prefix(self, tokens: list[int]) -> int:
        checked.append(len(tokens))
        raise InjectedFault("the grammar failed on a draft")

    monkeypatch.setattr(constrained.GrammarGuide, "valid_prefix", valid_prefix)
    ledger = Ledger(engine)
    victim_call = _victim_generate(engine, docs, constraint=constrained.OutputConstraint.any_json_object())
    others, victim = _together(engine, prompts, victim_call)
    assert isinstance(victim, InjectedFault) and "grammar" in str(victim) and checked
    _assert_alone_and_settled(engine, others, reference, ledger)


def test_a_release_callback_that_raises_fails_its_request_alone_and_the_rest_still_run(make_engine, docs, monkeypatch):
    engine = _engine(make_engine, docs)
    prompts = _prompts(docs)
    reference = _alone(engine, prompts)
    memory, admission = engine._requests.memory, engine._requests.memory.admission
    raised: list[int] = []

    def broken_release() -> None:
        raised.append(1)
        raise InjectedFault("releasing its place failed")

    def with_broken_release(granted):
        if granted is not None:
            granted[0].on_release.insert(0, broken_release)  # the lease's release comes after it
        return granted

    def victims_admission(*args):  # made on the caller's thread, granted on the loop's
        if threading.current_thread().name != "victim":
            return admission(*args)
        return Admission(lambda: with_broken_release(memory.try_admit(*args)))

    monkeypatch.setattr(memory, "admission", victims_admission)
    ledger = Ledger(engine)
    others, victim = _together(engine, prompts, _victim_generate(engine, docs))
    assert isinstance(victim, InjectedFault) and "releasing" in str(victim) and raised == [1]
    _assert_alone_and_settled(engine, others, reference, ledger)  # its lease went back after the raise


def _wrap_victim_work(engine: KVBoost, monkeypatch, wrap: Callable[[Any], Any]) -> None:
    """The victim's prompt work (submitted from its thread) runs inside ``wrap(steps)``."""
    loop, submit_many = engine._loop, engine._loop.submit_many

    def submitting(works, **kwargs):
        if threading.current_thread().name == "victim":
            works = [(wrap(steps), cancellation) for steps, cancellation in works]
        return submit_many(works, **kwargs)

    monkeypatch.setattr(loop, "submit_many", submitting)


def test_a_work_whose_cleanup_raises_fails_its_request_alone(make_engine, docs, monkeypatch, caplog):
    """The victim is cancelled as its prefill starts; closing its work raises in its cleanup.
    It ends as cancelled, its own cleanup ran, and the others go on."""
    engine = _engine(make_engine, docs, prefill_chunk_tokens=16)  # its prefill takes many slices
    prompts = _prompts(docs)
    reference = _alone(engine, prompts)
    cancellation, cleanups = Cancellation(), []

    def cleanup_raises(steps):
        reply = None
        try:
            while True:
                try:
                    request = steps.send(reply)
                except StopIteration as stop:
                    return stop.value
                # Cancelled as its first pass starts (many slices), where its own steps cannot
                # see it: the loop drops the work at its next step and closes it.
                cancellation.cancel()
                reply = yield request
        except GeneratorExit:
            steps.close()  # its own cleanup runs
            cleanups.append(1)
            raise InjectedFault("its cleanup failed") from None

    _wrap_victim_work(engine, monkeypatch, cleanup_raises)

    def victim() -> Any:
        with cancelling(cancellation):
            return engine.generate(_victim_prompt(docs), max_new_tokens=VICTIM_TOKENS, reuse=False)

    ledger = Ledger(engine)
    with caplog.at_level("WARNING", logger="kvboost_rag.engine_loop.work"):
        others, outcome = _together(engine, prompts, victim)
    assert isinstance(outcome, RequestCancelled) and cleanups == [1]
    assert "cleanup failed: InjectedFault: its cleanup failed" in caplog.text
    _assert_alone_and_settled(engine, others, reference, ledger)


def test_a_cache_whose_length_cannot_be_read_before_a_pass_fails_its_request_alone(make_engine, docs, monkeypatch):
    """The victim's cache raises when the loop reads its length before a packed pass (from
    its second pass on): that request ends with it; the pass runs for the others."""
    engine = _engine(make_engine, docs, prefill_chunk_tokens=16)
    prompts = _prompts(docs)
    reference = _alone(engine, prompts)
    victim_caches: set[int] = set()
    raised: list[int] = []

    def arm(request: TokenPass) -> None:  # armed once its first pass ran
        victim_caches.add(id(request.cache))

    _wrap_victim_work(engine, monkeypatch, lambda steps: _relay(steps, after=arm))
    real_length = BufferedCache.get_seq_length

    def get_seq_length(self, *args, **kwargs):
        if id(self) in victim_caches and _called_from_the_loops_forward():
            raised.append(1)
            raise InjectedFault("its cache's length could not be read")
        return real_length(self, *args, **kwargs)

    monkeypatch.setattr(BufferedCache, "get_seq_length", get_seq_length)
    ledger = Ledger(engine)
    others, victim = _together(engine, prompts, _victim_generate(engine, docs))
    assert isinstance(victim, InjectedFault) and "length" in str(victim) and raised
    _assert_alone_and_settled(engine, others, reference, ledger)


def _relay(steps, before=None, after=None):
    """A work's requests relayed to the loop as they are; ``before`` is called on each token
    pass before it goes, ``after`` once it ran."""
    reply = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as stop:
            return stop.value
        token_pass = isinstance(request, TokenPass)
        if token_pass and before is not None:
            before(request)
        reply = yield request
        if token_pass and after is not None:
            after(request)


def _called_from_the_loops_forward() -> bool:
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "_forward" and "engine_loop" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_a_slice_whose_rows_cannot_be_prepared_fails_its_work_alone(make_engine, docs, monkeypatch):
    """``before_slices`` (zeroing the rows a cut pass's later slices write) raises for one
    work: that work ends with it, the others run on."""
    engine = _engine(make_engine, docs, prefill_chunk_tokens=16)
    prompts = _prompts(docs)
    reference = _alone(engine, prompts)
    raised: list[int] = []
    real = TokenPass.before_slices

    def before_slices(self, first_stop: int) -> None:
        if threading.current_thread().name == "kvboost-engine" and getattr(self, "victim", False):
            raised.append(1)
            raise InjectedFault("its rows could not be zeroed")
        real(self, first_stop)

    def mark(request: TokenPass) -> None:
        request.victim = True

    monkeypatch.setattr(TokenPass, "before_slices", before_slices)
    _wrap_victim_work(engine, monkeypatch, lambda steps: _relay(steps, before=mark))
    ledger = Ledger(engine)
    others, victim = _together(engine, prompts, _victim_generate(engine, docs))
    assert isinstance(victim, InjectedFault) and "zeroed" in str(victim) and raised
    _assert_alone_and_settled(engine, others, reference, ledger)


# ---------------------------------------------------------------------- the loop's own fault
class LoopFault(BaseException):
    """A fault of the loop itself (no request's): it ends everything the loop holds."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_loop_fault_settles_every_future_and_reader_even_when_a_cleanup_raises(make_engine, docs):
    engine = _engine(make_engine, docs)
    loop = engine._loop
    stream = engine.stream(_prompts(docs)[0], max_new_tokens=10_000, reuse=False)
    next(iter(stream))  # it decodes: its handle is in the running batch
    fresh: list[Any] = []

    def waiting():
        yield ModelCall(lambda: None)
        yield ModelCall(lambda: None)

    def cleanup_raises():
        try:
            yield ModelCall(lambda: None)
            yield ModelCall(lambda: None)
        except GeneratorExit:
            # Work queued while the dying loop settles the rest goes to a fresh thread.
            submitter = threading.Thread(target=lambda: fresh.append(loop.submit(answer())))
            submitter.start()
            submitter.join(HUNG_SECONDS)
            raise InjectedFault("its cleanup failed")

    def answer():
        yield ModelCall(lambda: None)
        return 42

    def dying():
        yield ModelCall(lambda: None)
        yield ModelCall(_raise_loop_fault)

    with loop_held(engine):
        # The oldest work's passes that run whole go first: the dying one's, while the others wait.
        futures = [loop.submit(dying()), loop.submit(cleanup_raises()), loop.submit(waiting()), loop.submit(waiting())]
    for future in futures:
        with pytest.raises(LoopFault):
            future.result(HUNG_SECONDS)
    with pytest.raises(LoopFault):
        for _ in stream:
            pass
    assert fresh and fresh[0].result(HUNG_SECONDS) == 42  # never swept with the old error
    wait_for(lambda: engine._places.admitted == 0 and not loop.active)
    assert engine.generate(_prompts(docs)[1], max_new_tokens=4).generated_tokens == 4


def _raise_loop_fault() -> None:
    raise LoopFault()


# ---------------------------------------------------------------------- bounded waits
def test_cache_stats_under_a_wedged_tier_return_within_their_timeout(make_engine, docs, caplog):
    engine = _engine(make_engine, docs)
    gate = threading.Event()
    engine._cache.writer.submit(lambda: gate.wait(HUNG_SECONDS), nbytes=1)  # a tier that does not answer
    try:
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="kvboost_rag.cache.manager"):
            stats = engine.cache_stats(flush_timeout=0.2)
        assert time.monotonic() - start < 0.2 + 10  # bounded (the margin is a loaded machine's)
        assert stats.documents == 4 and "still queued" in caplog.text
        start = time.monotonic()
        engine.cache_stats()  # the default bound
        assert time.monotonic() - start < STATS_FLUSH_SECONDS + 10
        assert not engine.flush(timeout=0)
    finally:
        gate.set()
    assert engine.flush(timeout=HUNG_SECONDS) and engine.cache_stats(flush_timeout=None).documents == 4


EXIT_SCRIPT = """
import logging, threading, time
logging.basicConfig(level=logging.WARNING)
from kvboost_rag.cache import write_worker
write_worker.EXIT_FLUSH_SECONDS = 0.5
worker = write_worker.WriteWorker(1 << 20)
done = []
worker.submit(lambda: done.append("first"), nbytes=10)
assert worker.flush(timeout=60)
worker.submit(lambda: threading.Event().wait(), nbytes=100)  # a wedged tier
worker.submit(lambda: None, nbytes=50)
print("exiting", done, flush=True)
"""


def test_exit_flushes_within_its_timeout_and_says_what_it_dropped(tmp_path):
    script = tmp_path / "wedged.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "exiting ['first']" in done.stdout, done.stderr[-2000:]
    assert "exiting with 2 cache writes (150 bytes) not done" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 110


# ---------------------------------------------------------------------- fork
#: Seconds a forked child may take before its alarm ends it (a hang fails the test).
CHILD_SECONDS = 120


def test_a_forked_child_answers_as_its_parent(make_engine, docs):
    """Fork after a request, while the parent's loop thread is busy, its write-back has run
    and the async bridges' pool has threads: the child answers, through a fresh loop, a fresh
    pool and its own write-back, as the parent did."""
    engine = _engine(make_engine, docs)
    prompt, other = _prompts(docs)[:2]
    start = time.perf_counter()
    expected = engine.generate(prompt, max_new_tokens=TOKENS, reuse=False).token_ids
    idle_seconds = time.perf_counter() - start
    assert asyncio.run(call_in_thread(lambda: 1)) == 1  # the pool's threads exist now
    read, write = os.pipe()
    with loop_held(engine):  # the parent's loop thread is busy at the fork: gone in the child
        pid = os.fork()
        if pid == 0:  # the child: never leaves this block but by os._exit
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the alarm ends it whatever it waits on
                signal.alarm(CHILD_SECONDS)
                os.close(read)
                code = _child(engine, prompt, other, write)
            finally:
                os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as reply:
        text = reply.read()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, text)
    child = json.loads(text)
    assert child["tokens"] == expected and child["pooled"] == 7 and child["flushed"] and child["other"] == TOKENS
    assert child["seconds"] < 20 * idle_seconds + 10  # its idle time, give or take a loaded machine


def _child(engine: KVBoost, prompt: str, other: str, write: int) -> int:
    """The forked child's requests; what it saw goes back through ``write``."""
    start = time.perf_counter()
    tokens = engine.generate(prompt, max_new_tokens=TOKENS, reuse=False).token_ids
    seconds = time.perf_counter() - start
    pooled = asyncio.run(call_in_thread(lambda: 7))
    produced = engine.generate(other, max_new_tokens=TOKENS).generated_tokens  # stores what it taught
    flushed = engine.flush(timeout=60)
    os.write(write, json.dumps({"tokens": tokens, "seconds": seconds, "pooled": pooled, "other": produced, "flushed": flushed}).encode())
    os.close(write)
    return 0
