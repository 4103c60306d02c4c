"""Async calls and iteration over the engine's blocking API, for async integrations.

Each call runs on a thread of one shared, bounded pool (:data:`MAX_CALL_THREADS` threads made
as needed and reused, not daemons), not in the event loop's default executor: that executor
has a handful of workers (``min(32, cpus + 4)``), which would cap how many concurrent requests
reach the engine and decode together in one batch. The threads only wait: every forward pass
runs on the engine loop's own thread.

Each call and each iteration runs under a
:class:`~kvboost_rag.cancellation.Cancellation` of its own (the ambient one, which the
engine's streams started or iterated there follow): cancelling the awaiting task, or closing
the async iterator early, cancels it, so the engine stops that work (its queued request leaves
the queue, its prompt work stops at the next step, its sequence leaves the batch) instead of
running it to its end for nobody. A call still queued for a thread when its task is cancelled
never runs. A forked child makes a pool of its own at its first call.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvboost_rag.cancellation import Cancellation, cancelling

T = TypeVar("T")
_DONE = object()
#: Most threads the bridges run calls on at once (more calls wait for one, in order): well
#: above what an engine decodes together (``max_batch_size``) and what the server admits.
MAX_CALL_THREADS = 256
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def call_threads() -> ThreadPoolExecutor:
    """The bridges' shared pool of threads (made on first use; made again in a forked child,
    where the parent's threads do not exist)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_CALL_THREADS, thread_name_prefix="kvboost-call")
        return _pool


def _forget_pool_in_child() -> None:
    """After ``os.fork``, in the child: the pool's threads stayed in the parent (a call given
    to it would wait for ever), and its lock may be held; the next call makes a new pool."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pool_in_child)


async def call_in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking call on a thread of the bridges' pool and await its result.

    Context variables are copied into the thread. Cancelling the awaiting task cancels the
    call's ambient cancellation: an engine call stops early (``generate`` then raises
    :class:`~kvboost_rag.errors.RequestCancelled` in the thread, which nobody awaits); other
    work runs to its end, as with :func:`asyncio.to_thread`.

    Args:
        fn: The blocking callable.
        *args: Its positional arguments.
        **kwargs: Its keyword arguments.
    """
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    cancellation = Cancellation()

    def under_cancellation() -> T:
        with cancelling(cancellation):
            return fn(*args, **kwargs)

    try:
        return await loop.run_in_executor(call_threads(), context.run, under_cancellation)
    except asyncio.CancelledError:
        cancellation.cancel()
        raise


async def iterate_in_thread(factory: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Run a blocking iterator in one worker thread and yield its items on the event loop.

    The whole iteration happens in a single thread; the loop only awaits a queue, so it is
    never blocked. Context variables are copied into the worker. When the consumer stops
    early (or its task is cancelled), the iteration's cancellation is set: an engine stream
    stops where it is (waiting, prefilling, decoding) rather than after its next piece; then
    the worker closes the iterator.

    Args:
        factory: Builds the iterator; called in the worker thread.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    cancellation = Cancellation()

    def post(item: Any, error: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
        except RuntimeError:  # the loop closed: nobody is listening, so the work stops
            cancellation.cancel()

    def produce() -> None:
        iterator: Iterator[T] | None = None
        try:
            with cancelling(cancellation):
                iterator = factory()
                for item in iterator:
                    if cancellation.cancelled:
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

    worker = asyncio.ensure_future(call_in_thread(produce))
    finished = False
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                finished = True
                if error is not None:
                    raise error
                break
            yield item
    finally:
        if not finished:  # the consumer left early: stop the engine's work where it is
            cancellation.cancel()
        await asyncio.shield(worker)
