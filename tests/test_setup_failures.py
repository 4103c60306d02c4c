"""A failure anywhere in a request's set-up gives back everything it holds.

Each test makes one step of a request's set-up raise something that is not the engine's own
error (an allocation failing as the loop admits it, a lookup failing, Ctrl-C while a batch is
set up), then checks that no place, no
counted byte and no lent buffer is left behind, and that the next call is answered (before,
after ``max_batch_size`` such failures every request waited for ever for a place).
"""

from __future__ import annotations

import threading

import pytest
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost


class AllocationFailed(MemoryError):
    """The allocation a test makes fail."""


def _engine(make_engine, docs, **settings) -> KVBoost:
    engine = make_engine("llama", **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:2])
    return engine


def _fail_lease_calls(engine: KVBoost, monkeypatch, failing: set[int], error: BaseException) -> list[int]:
    """Make the ``failing`` calls (counted from 1) of the engine's buffer lending raise
    ``error``; returns the running count of calls."""
    memory, original = engine._requests.memory, engine._requests.memory.lend
    calls = [0]

    def lease(capacity: int):
        calls[0] += 1
        if calls[0] in failing:
            raise error
        return original(capacity)

    monkeypatch.setattr(memory, "lend", lease)
    return calls


def _assert_nothing_held(engine: KVBoost) -> None:
    assert engine._places.admitted == 0 and engine._loop.waiting == 0
    assert engine.flush(timeout=60)
    assert engine._places.held_bytes == 0
    assert engine._requests.memory.host_buffers.lent_bytes == 0


def _in_time(call, timeout: float = 60.0):
    """``call()``'s result or exception, run on a daemon thread (a leaked place would make it
    wait for ever: the test then fails instead of hanging)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert outcome, f"the call did not return within {timeout} s"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _answers_in_time(engine: KVBoost, prompt: str) -> None:
    """The next call returns."""
    assert _in_time(lambda: engine.generate(prompt, max_new_tokens=3)).generated_tokens > 0


def test_an_allocation_failing_right_after_admission_gives_the_place_back(make_engine, docs, monkeypatch):
    engine = _engine(make_engine, docs, max_batch_size=1)
    prompt = rag_prompt(docs[:2], "What is it?")
    _fail_lease_calls(engine, monkeypatch, {1, 2, 3}, AllocationFailed("no memory for the buffers"))
    for _ in range(3):  # more failures than places: each must give its place back
        with pytest.raises(AllocationFailed):
            _in_time(lambda: engine.generate(prompt, max_new_tokens=3))
    _assert_nothing_held(engine)
    _answers_in_time(engine, prompt)
    _assert_nothing_held(engine)


@pytest.mark.parametrize("failing", [1, 3, 5])
def test_a_batch_prompt_whose_allocation_fails_fails_alone_and_the_rest_are_answered(make_engine, docs, monkeypatch, failing):
    """The ``failing``-th prompt's buffers cannot be allocated, in a batch of 5 with 2 places
    (so later prompts wait for places while earlier ones run)."""
    engine = _engine(make_engine, docs, max_batch_size=2)
    prompts = [rag_prompt([docs[i % 2]], f"Question {i}?") for i in range(5)]
    reference = [engine.generate(p, max_new_tokens=4).output_text for p in prompts]
    _fail_lease_calls(engine, monkeypatch, {failing}, AllocationFailed("no memory for the buffers"))
    outputs = _in_time(lambda: engine.generate_batch(prompts, max_new_tokens=4))
    for i, (output, expected) in enumerate(zip(outputs, reference), start=1):
        if i == failing:
            assert isinstance(output, AllocationFailed)
        else:
            assert output.output_text == expected
    _assert_nothing_held(engine)
    _answers_in_time(engine, prompts[0])


def _fail_lookups(engine: KVBoost, monkeypatch, failing: set[int], error: BaseException) -> None:
    """Make the ``failing`` calls (counted from 1) of the engine's cache lookup (on the
    caller's thread, before its work goes to the loop) raise ``error``."""
    prefiller, original = engine._requests.prefiller, engine._requests.prefiller.lookup
    calls = [0]

    def lookup(plan):
        calls[0] += 1
        if calls[0] in failing:
            raise error
        return original(plan)

    monkeypatch.setattr(prefiller, "lookup", lookup)


@pytest.mark.parametrize("interrupted", [1, 4])
def test_an_interrupt_in_a_batch_prompts_set_up_gives_back_every_prompts_place(make_engine, docs, monkeypatch, interrupted):
    """Ctrl-C while a later prompt is set up ends the call; the prompts already prepared go to
    the loop cancelled and are drained, so nothing stays held (repeated past
    ``max_batch_size``)."""
    engine = _engine(make_engine, docs, max_batch_size=2)
    prompts = [rag_prompt([docs[i % 2]], f"Question {i}?") for i in range(5)]
    for _ in range(3):
        _fail_lookups(engine, monkeypatch, {interrupted}, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            _in_time(lambda: engine.generate_batch(prompts, max_new_tokens=4))
        monkeypatch.undo()
        _assert_nothing_held(engine)
    _answers_in_time(engine, prompts[0])


def test_a_lookup_failing_gives_back_everything(make_engine, docs, monkeypatch):
    engine = _engine(make_engine, docs, max_batch_size=1)
    prompt = rag_prompt(docs[:2], "What is it?")
    _fail_lookups(engine, monkeypatch, {1, 2}, AllocationFailed("a lookup's copy could not be allocated"))
    for _ in range(2):
        with pytest.raises(AllocationFailed):
            _in_time(lambda: engine.generate(prompt, max_new_tokens=3))
        _assert_nothing_held(engine)
    _answers_in_time(engine, prompt)


def test_concurrent_callers_beside_failing_allocations_are_all_answered(make_engine, docs, monkeypatch):
    """Every other allocation fails while eight callers ask at once through two places: the
    others are answered, and nothing stays held."""
    engine = _engine(make_engine, docs, max_batch_size=2)
    prompts = [rag_prompt([docs[i % 2]], f"Question {i}?") for i in range(8)]
    _fail_lease_calls(engine, monkeypatch, set(range(1, 40, 2)), AllocationFailed("no memory"))
    barrier = threading.Barrier(len(prompts))

    def ask(prompt: str):
        barrier.wait()
        try:
            return engine.generate(prompt, max_new_tokens=3)
        except AllocationFailed as error:
            return error

    outcomes: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: outcomes.update({i: ask(prompts[i])}), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(outcomes) == len(prompts), "a caller did not return"
    outcomes = list(outcomes.values())
    failed = [o for o in outcomes if isinstance(o, AllocationFailed)]
    assert 0 < len(failed) < len(prompts)
    assert all(o.generated_tokens > 0 for o in outcomes if not isinstance(o, AllocationFailed))
    _assert_nothing_held(engine)
