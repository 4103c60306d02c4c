"""Sequencing threads in tests without timing: wait for a state another thread reaches, hold
the engine loop busy, and cancel a request at a known stage (its work waiting in the loop's
queue while the test holds the loop).

Nothing here decides a test by how long something took: the bound of :func:`wait_for` only
ends a test that would otherwise hang.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: Seconds :func:`wait_for` waits at most (a hung test fails instead of blocking the suite).
HUNG_SECONDS = 60.0


def wait_for(condition: Callable[[], bool], bound: float = HUNG_SECONDS, every: float = 0.001) -> None:
    """Return once ``condition()`` holds (polled every ``every`` seconds).

    Raises:
        AssertionError: It did not hold within ``bound`` seconds (a hung test).
    """
    deadline = time.monotonic() + bound
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError("condition not reached")
        time.sleep(every)


@contextmanager
def loop_held(engine: Any) -> Iterator[None]:
    """The engine loop of ``engine`` (a :class:`~kvboost_rag.KVBoost`) busy with another piece
    of work for the duration: work submitted meanwhile waits in its queue."""
    from kvboost_rag.hf.passes import ModelCall

    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(HUNG_SECONDS)

    def steps():
        yield ModelCall(hold)

    future = engine._loop.submit(steps())
    if not holding.wait(HUNG_SECONDS):
        raise AssertionError("the engine loop never ran the holding work")
    try:
        yield
    finally:
        release.set()
        future.result(HUNG_SECONDS)


async def cancel_while_waiting_for_the_model(engine: Any, start: Callable[[], Awaitable[Any]]) -> None:
    """Start ``start()`` while the test holds the engine loop, cancel its task once the
    engine's request waits in the loop's queue, and return once the request left the queue and
    gave its place back, the loop still held: the cancellation reached the engine.

    Args:
        engine: A :class:`~kvboost_rag.KVBoost`.
        start: Makes the awaitable of one async call or stream (an integration's).
    """
    with loop_held(engine):
        task = asyncio.ensure_future(start())
        await asyncio.to_thread(wait_for, lambda: engine._loop.queued == 1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await asyncio.to_thread(wait_for, lambda: engine._loop.queued == 0 and engine._places.admitted == 0)
