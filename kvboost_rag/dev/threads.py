"""Sequencing threads in tests without timing: wait for a state another thread reaches, and
cancel a request at a known stage (waiting for the model, which the test holds).

Nothing here decides a test by how long something took: the bound of :func:`wait_for` only
ends a test that would otherwise hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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


async def cancel_while_waiting_for_the_model(engine: Any, start: Callable[[], Awaitable[Any]]) -> None:
    """Start ``start()`` while the test holds the model (another prompt's turn), cancel its task
    once the engine's request waits for the model, and return once the request left that wait
    and gave its place back, the model still held: the cancellation reached the engine.

    Args:
        engine: A :class:`~kvboost_rag.KVBoost`.
        start: Makes the awaitable of one async call or stream (an integration's).
    """
    turns = engine._requests.turns
    with turns.prompt_work():
        task = asyncio.ensure_future(start())
        await asyncio.to_thread(wait_for, lambda: turns._prompt_waiting == 1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await asyncio.to_thread(wait_for, lambda: turns._prompt_waiting == 0 and engine._scheduler.admitted == 0)
