"""The model's turns: prompt work first, decode steps lent a turn at its boundaries, waits that
end on cancellation. Threads are sequenced with events and the turns' own counters (a fake
clock where durations matter): nothing here depends on timing."""

from __future__ import annotations

import threading

import pytest

from kvboost_rag.cancellation import Cancellation, ambient, cancelling
from kvboost_rag.dev.threads import HUNG_SECONDS, wait_for
from kvboost_rag.errors import RequestCancelled
from kvboost_rag.hf.turns import ModelTurns




class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _decode_in_thread(turns: ModelTurns, log: list[str], name: str = "step") -> threading.Thread:
    def run() -> None:
        with turns.decode_step():
            log.append(name)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_decode_step_waits_for_prompt_work_until_it_is_lent_a_turn():
    turns, log = ModelTurns(max_decode_wait=0.0), []
    with turns.prompt_work():
        stepper = _decode_in_thread(turns, log)
        wait_for(lambda: turns._decode_waiting == 1)
        assert log == []  # prompt work holds the model
        turns.between_chunks()  # a boundary: the waiting step runs, then the model comes back
        assert log == ["step"] and turns.lent_steps == 1
        turns.between_chunks()  # nobody waits: nothing lent
        assert turns.lent_steps == 1
    stepper.join(HUNG_SECONDS)


def test_the_lent_model_comes_back_to_the_same_prompt_work():
    turns, log = ModelTurns(max_decode_wait=0.0), []
    other_started = threading.Event()

    def other_prompt() -> None:
        other_started.set()
        with turns.prompt_work():
            log.append("other prompt")

    with turns.prompt_work():
        other = threading.Thread(target=other_prompt)
        other.start()
        other_started.wait(HUNG_SECONDS)
        wait_for(lambda: turns._prompt_waiting == 1)
        stepper = _decode_in_thread(turns, log)
        wait_for(lambda: turns._decode_waiting == 1)
        turns.between_chunks()
        log.append("first prompt again")
    other.join(HUNG_SECONDS)
    stepper.join(HUNG_SECONDS)
    assert log == ["step", "first prompt again", "other prompt"]


def test_decode_waits_its_share_of_a_step_before_it_is_lent_the_model():
    clock = Clock()
    turns, log = ModelTurns(max_decode_wait=1.0, clock=clock), []
    with turns.decode_step():
        clock.now = 0.5  # a step takes 0.5 s
    assert turns.step_seconds == 0.5
    with turns.prompt_work():  # from 0.5 on
        stepper = _decode_in_thread(turns, log)
        wait_for(lambda: turns._decode_waiting == 1)  # waiting since 0.5
        clock.now = 0.6
        turns.between_chunks()  # waited 0.1, the next slice like the last (0.1): 0.2 s < one step
        assert turns.lent_steps == 0 and log == []
        clock.now = 0.85
        turns.between_chunks()  # waited 0.35, the last slice 0.25: 0.6 s >= one step
        assert turns.lent_steps == 1 and log == ["step"]
    stepper.join(HUNG_SECONDS)


def test_decode_waits_longer_while_more_prompts_wait_for_the_model():
    clock = Clock()
    turns, log = ModelTurns(max_decode_wait=1.0, clock=clock), []
    with turns.decode_step():
        clock.now = 0.5  # a step takes 0.5 s
    with turns.prompt_work():
        waiter_in = threading.Event()

        def waiting_prompt() -> None:
            waiter_in.set()
            with turns.prompt_work():
                log.append("queued prompt")

        queued = threading.Thread(target=waiting_prompt)
        queued.start()
        waiter_in.wait(HUNG_SECONDS)
        wait_for(lambda: turns._prompt_waiting == 1)
        stepper = _decode_in_thread(turns, log)
        wait_for(lambda: turns._decode_waiting == 1)  # waiting since 0.5
        clock.now = 0.85
        turns.between_chunks()  # 0.6 s by the next boundary: one step, but two prompts share the model
        assert turns.lent_steps == 0
        clock.now = 1.1
        turns.between_chunks()  # waited 0.6, the last slice 0.25: 0.85 s < two steps
        assert turns.lent_steps == 0
        clock.now = 1.3
        turns.between_chunks()  # waited 0.8, the last slice 0.2: two steps
        assert turns.lent_steps == 1 and log == ["step"]
    queued.join(HUNG_SECONDS)
    stepper.join(HUNG_SECONDS)
    assert log == ["step", "queued prompt"]


def test_prompt_work_is_reentrant_and_boundaries_elsewhere_do_nothing():
    turns = ModelTurns(max_decode_wait=0.0)
    turns.between_chunks()  # no prompt work here: nothing
    with turns.prompt_work(), turns.prompt_work():
        turns.between_chunks()
    with turns.decode_step():  # the model is free again
        pass


def test_a_cancelled_request_stops_waiting_for_its_turn():
    turns = ModelTurns()
    cancellation = Cancellation()
    outcome: list[object] = []
    waiting = threading.Event()

    def prefill() -> None:
        waiting.set()
        try:
            with turns.prompt_work(cancellation):
                outcome.append("ran")
        except RequestCancelled as error:
            outcome.append(error)

    with turns.prompt_work():
        thread = threading.Thread(target=prefill)
        thread.start()
        waiting.wait(HUNG_SECONDS)
        wait_for(lambda: turns._prompt_waiting == 1)
        cancellation.cancel()
        thread.join(HUNG_SECONDS)
        assert not thread.is_alive() and isinstance(outcome[0], RequestCancelled)
        assert turns._prompt_waiting == 0
    with turns.prompt_work(Cancellation()):  # the turn is free: nothing leaked
        pass


def test_a_boundary_of_cancelled_prompt_work_raises():
    turns = ModelTurns()
    cancellation = Cancellation()
    with pytest.raises(RequestCancelled), turns.prompt_work(cancellation):
        turns.between_chunks()
        cancellation.cancel()
        turns.between_chunks()
    assert turns._holder is None


def test_cancellation_calls_its_watchers_once_and_follows_an_ambient_one():
    outer, inner, calls = Cancellation(), Cancellation(), []
    stop = inner.watch(lambda: calls.append("inner"))
    with cancelling(outer):
        unfollow = inner.follow(ambient())
    assert ambient() is None
    outer.cancel()
    outer.cancel()
    assert inner.cancelled and calls == ["inner"]
    stop()
    unfollow()
    late = []
    inner.watch(lambda: late.append(1))  # already cancelled: called at once
    assert late == [1]
    with pytest.raises(RequestCancelled):
        inner.check()
