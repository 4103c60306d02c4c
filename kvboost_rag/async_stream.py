"""Async iteration over the engine's blocking streams, for async integrations."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(factory: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Run a blocking iterator in one worker thread and yield its items on the event loop.

    The whole iteration happens in a single thread; the loop only awaits a queue, so it is
    never blocked. Context variables are copied into the worker. When the consumer stops
    early, the worker stops after the item in progress and closes the iterator.

    Args:
        factory: Builds the iterator; called in the worker thread.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    stop_requested = threading.Event()

    def post(item: Any, error: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
        except RuntimeError:  # the loop closed: nobody is listening
            stop_requested.set()

    def produce() -> None:
        iterator: Iterator[T] | None = None
        try:
            iterator = factory()
            for item in iterator:
                if stop_requested.is_set():
                    break
                post(item)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, re-raised there
            post(_DONE, error)
        else:
            post(_DONE)
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()

    worker = asyncio.ensure_future(asyncio.to_thread(produce))
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                if error is not None:
                    raise error
                break
            yield item
    finally:
        stop_requested.set()
        await asyncio.shield(worker)
