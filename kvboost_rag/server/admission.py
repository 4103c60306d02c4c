"""Bounded admission: at most ``max_pending`` requests held at once, the rest told to retry.

A request holds a :class:`Slot` from its admission until its answer is complete (a stream:
until its last event is sent or its client is gone). The engine queues admitted requests for
a place in its decode batch (``max_batch_size``); requests beyond ``max_pending`` are refused
at once with a 429 and ``Retry-After``, and every request after :meth:`Admission.close` (the
server shutting down) with a 503. Admission runs on the event loop: no locks.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvboost_rag.server.errors import APIError

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Slot:
    """One admitted request's place; :meth:`release` gives it back (once)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        """Give the place back; later calls do nothing."""
        if self._admission is not None:
            self._admission.leave()
            self._admission = None


class Admission:
    """Counts the requests the server holds and refuses those over the bound.

    Args:
        limit: Most requests held at once.
        retry_after_seconds: The ``Retry-After`` of a refusal.
    """

    def __init__(self, limit: int, retry_after_seconds: int) -> None:
        self.limit = limit
        self.retry_after_seconds = retry_after_seconds
        self._active = 0
        self._closing = False

    @property
    def active(self) -> int:
        """Requests held now."""
        return self._active

    @property
    def closing(self) -> bool:
        """Whether the server is shutting down (new requests get a 503)."""
        return self._closing

    def close(self) -> None:
        """Refuse every new request from now on (503); held requests finish."""
        self._closing = True

    def admit(self) -> Slot:
        """A place for one more request.

        Raises:
            APIError: 503 while shutting down, 429 when ``limit`` requests are held; both
                with ``Retry-After``.
        """
        headers = {"Retry-After": str(self.retry_after_seconds)}
        if self._closing:
            raise APIError(503, "the server is shutting down; retry on another replica", code="shutting_down",
                           headers=headers)
        if self._active >= self.limit:
            logger.info("refused a request: %d requests held (max_pending=%d)", self._active, self.limit)
            raise APIError(
                429,
                f"the server holds {self._active} requests, its limit (max_pending={self.limit}); retry after "
                f"{self.retry_after_seconds} s",
                code="rate_limit_exceeded",
                headers=headers,
            )
        self._active += 1
        return Slot(self)

    def leave(self) -> None:
        """One held request is over (called by its :class:`Slot`)."""
        self._active -= 1

    async def within(self, answer: Callable[[Slot], Awaitable[tuple[T, bool]]]) -> T:
        """Run ``answer`` holding a place.

        Args:
            answer: Takes the slot; returns its result and whether it handed the slot over
                (a stream releases it when it ends); else the slot goes back on return.

        Raises:
            APIError: As :meth:`admit`.
        """
        slot = self.admit()
        handed_over = False
        try:
            result, handed_over = await answer(slot)
            return result
        finally:
            if not handed_over:
                slot.release()
