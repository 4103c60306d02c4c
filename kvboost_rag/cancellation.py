"""A request's cancellation: set from any thread, seen at every stage of its work.

A :class:`Cancellation` is a flag plus the wake-ups of whatever waits for the request: its
prompt work queued in the engine loop, for admission or for its first pass
(:meth:`~kvboost_rag.engine_loop.work.PromptWork.withdraw`), its pieces from the loop. Setting it makes each of them end at once, prompt work the loop runs at
its next step boundary, and a decoding sequence leave the batch at the next step.

The async bridges (:mod:`kvboost_rag.integration.async_stream`) run each blocking call under
an *ambient* cancellation (:func:`cancelling`): a stream started or iterated there picks it up
(:func:`ambient`), so cancelling the awaiting task or closing the async iterator cancels the
engine's work, whatever wraps the engine's stream.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvboost_rag.errors import RequestCancelled

_ambient: contextvars.ContextVar[Cancellation | None] = contextvars.ContextVar("kvboost_cancellation", default=None)


class Cancellation:
    """A request's cancel flag; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._watchers: dict[int, Callable[[], None]] = {}
        self._next = 0

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._set

    def cancel(self) -> None:
        """Cancel the request (again: nothing); every watcher is called once, in this thread."""
        with self._lock:
            if self._set:
                return
            self._set = True
            watchers, self._watchers = list(self._watchers.values()), {}
        for watcher in watchers:
            watcher()

    def check(self) -> None:
        """Raise :class:`RequestCancelled` once cancelled."""
        if self._set:
            raise RequestCancelled("the request was cancelled")

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the request is cancelled (now, if it is already).

        Returns:
            Stops watching (once the wait it serves is over).
        """
        with self._lock:
            if not self._set:
                key, self._next = self._next, self._next + 1
                self._watchers[key] = callback
                return lambda: self._unwatch(key)
        callback()
        return lambda: None

    def follow(self, other: Cancellation | None) -> Callable[[], None]:
        """Be cancelled when ``other`` is (a stream under an ambient cancellation).

        Returns:
            Stops following.
        """
        if other is None or other is self:
            return lambda: None
        return other.watch(self.cancel)

    def _unwatch(self, key: int) -> None:
        with self._lock:
            self._watchers.pop(key, None)


def ambient() -> Cancellation | None:
    """The cancellation the current call runs under (:func:`cancelling`), if any."""
    return _ambient.get()


@contextmanager
def cancelling(cancellation: Cancellation) -> Iterator[Cancellation]:
    """Within the block, :func:`ambient` is ``cancellation``."""
    token = _ambient.set(cancellation)
    try:
        yield cancellation
    finally:
        _ambient.reset(token)
