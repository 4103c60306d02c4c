"""The check every engine test ends with: the engine's K/V memory is back to idle.

As vLLM's tests assert the block pool's free count after each test, every engine a test built
through ``make_engine`` must, once its loop and write-back settled, hold no place in the batch,
count no bytes for requests, have no buffer of its host pool or slot of its captured pool lent,
and have no write-back job queued.
"""

from __future__ import annotations

from kvboost_rag import KVBoost
from kvboost_rag.dev.threads import wait_for

#: Seconds an engine may take to settle (cancelled work leaves the loop at its next step).
SETTLE_SECONDS = 30.0


def memory_held(engine: KVBoost) -> dict[str, int]:
    """What the engine still holds for requests (every value 0 when idle)."""
    places, pool = engine._places, engine._requests.memory.host_buffers
    slots = None if engine._captured is None else engine._captured.pool
    return {
        "places": places.admitted,
        "waiting": engine._loop.waiting,
        "counted_bytes": places.held_bytes,
        "lent_bytes": 0 if pool is None else pool.lent_bytes,
        "lent_slots": 0 if slots is None else len(slots.slots) - slots.free_slots,
        "queued_prompt_work": engine._loop.queued,
        "decoding": engine._loop.decoding,
    }


def assert_memory_idle(engine: KVBoost) -> None:
    """Fail unless the engine settles to holding nothing for requests within
    :data:`SETTLE_SECONDS` (its write-back flushed first)."""
    engine.flush(timeout=SETTLE_SECONDS)
    try:
        wait_for(lambda: not any(memory_held(engine).values()), bound=SETTLE_SECONDS, every=0.01)
    except AssertionError:
        raise AssertionError(f"the engine's memory is not back to idle after the test: {memory_held(engine)}") from None
