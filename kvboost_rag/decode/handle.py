"""A request's view of its sequence while the engine loop decodes it."""

from __future__ import annotations

import queue
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from kvboost_rag.cancellation import Cancellation
from kvboost_rag.decode.step import DecodeSequence, FinishReason, StepResult
from kvboost_rag.errors import RequestCancelled


@dataclass(eq=False)
class DecodeHandle:
    """The text pieces of one decoding sequence, posted by the engine loop and read by its
    request's thread.

    Attributes:
        sequence: The sequence.
        reservation: Its place in the batch (given back when it leaves).
        cancellation: Set by :meth:`cancel`.
    """

    sequence: DecodeSequence
    reservation: Any = None
    cancellation: Cancellation = field(default_factory=Cancellation)
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def pieces(self) -> Generator[str, None, FinishReason]:
        """Text pieces as the loop decodes them; returns the finish reason.

        Raises:
            RequestCancelled: :meth:`cancel` was called before the sequence was done.
            Exception: What ended this sequence early (a failed step or token choice).
        """
        while True:
            kind, value = self._events.get()
            if kind == "piece":
                yield value
            elif kind == "done":
                return value
            elif kind == "cancelled":
                raise RequestCancelled("the request was cancelled while it decoded")
            else:
                raise value

    def cancel(self) -> None:
        """Leave the batch at the next step (no effect once done); a reader waiting in
        :meth:`pieces` stops waiting. Safe from any thread."""
        if not self.cancellation.cancelled:
            self.cancellation.cancel()
            self._events.put(("cancelled", None))

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self.cancellation.cancelled

    def ends_with(self, result: StepResult) -> bool:
        """Whether the sequence is over after this step's result."""
        return result.error is not None or self.sequence.done

    def deliver(self, result: StepResult) -> None:
        """Post a step's result to the request."""
        for piece in result.pieces:
            self._events.put(("piece", piece))
        if result.error is not None:
            self._events.put(("error", result.error))
        elif self.sequence.done:
            self._events.put(("done", self.sequence.finish_reason))
