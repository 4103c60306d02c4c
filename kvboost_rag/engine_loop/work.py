"""Prompt work as the engine loop holds it: a generator of passes, where its pass stands, its
future.

Prompt work (a request's prefill and first token, a warm, a batch's shared beginning) is a
generator (:data:`~kvboost_rag.hf.passes.PassSteps`) that yields what it needs from the model
and is sent the results. Besides model passes it may yield :class:`JoinDecode`, its last
request as a generation: its sequence joins the running batch and the loop answers with the
sequence's :class:`~kvboost_rag.decode.handle.DecodeHandle`. The loop runs the generator's host
work (between two requests) on its own thread; the caller waits on :attr:`PromptWork.future`.

A request's work comes with an :class:`Admission`: the memory it must be granted (a place in
the batch, its K/V buffers) before it starts. The loop grants it when there is room, in
arrival order; until then the work waits in the loop's queue and holds nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvboost_rag.cancellation import Cancellation
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.diagnosis import stage_times
from kvboost_rag.engine_loop.places import Reservation
from kvboost_rag.errors import RequestCancelled
from kvboost_rag.hf.packed import Segment, SegmentOutput
from kvboost_rag.hf.passes import ModelCall, PassResult, PassSteps, TokenPass
from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

G = TypeVar("G")


class Admission(Generic[G]):
    """The memory a request's prompt work must be granted before the loop starts it.

    Args:
        take: Takes the memory if there is room now and returns what it holds (``None``: no
            room, nothing taken). It runs on the loop's thread, in arrival order; when it
            raises, it has given back what it took, and the error ends the work alone.

    Attributes:
        granted: What ``take`` returned, once granted (the work reads it when it starts).
    """

    def __init__(self, take: Callable[[], G | None]) -> None:
        self._take = take
        self.granted: G | None = None

    def try_grant(self) -> bool:
        """Take the memory if there is room now; whether it was granted."""
        granted = self._take()
        if granted is None:
            return False
        self.granted = granted
        return True


@dataclass(eq=False)
class JoinDecode:
    """A request's sequence, prefilled and with its first token chosen, joining the batch.

    Attributes:
        sequence: The sequence (not done, its pending token chosen).
        reservation: Its place in the batch, given back when it leaves.
        before: Work on its cache to run before its first step (the lookahead repair), while
            its first token is already on its way to the caller; ``None``: none.
    """

    sequence: DecodeSequence
    reservation: Reservation
    before: PassSteps[Any] | None = None


class PromptWork:
    """One piece of prompt work in the engine loop.

    Args:
        steps: The work.
        cancellation: Its request's: once set, the loop drops it at the next step boundary and
            its future ends with :class:`~kvboost_rag.errors.RequestCancelled`.
        urgent: A request's way to its first token (a user waits for it), not background work.
        admission: The memory it must be granted before it starts (``None``: none).

    Attributes:
        future: Settled with what the work returns, or the exception that ended it.
        request: What it waits for (``None`` before it starts and once it is done).
    """

    def __init__(
        self, steps: PassSteps[Any], cancellation: Cancellation | None = None, urgent: bool = False,
        admission: Admission | None = None,
    ) -> None:
        self.steps = steps
        self.cancellation = cancellation
        self.urgent = urgent
        self.admission = admission
        #: Its admission was tried and found no room (it waits for memory, not for the budget).
        self.refused = False
        self.recording = stage_times.current()  # the submitting call's stage times, if it records them
        self.future: Future = Future()
        self.request: TokenPass | ModelCall | JoinDecode | None = None
        self.started = False
        self._claim = threading.Lock()  # started, or withdrawn: whichever comes first
        self._done = 0  # tokens of the current pass run so far
        self._stop = 0  # where the slice being run ends

    def withdraw(self) -> None:
        """Take the work back if the loop has not started it: its future ends at once with
        :class:`~kvboost_rag.errors.RequestCancelled` (it never touched the model or its
        buffers). Once started, the loop drops it at its next step boundary instead. Safe from
        any thread."""
        with self._claim:
            if self.started or self.future.done():
                return
            close_quietly(self.steps)
            self.future.set_exception(RequestCancelled("the request was cancelled before its prompt work started"))

    def start(self) -> TokenPass | ModelCall | JoinDecode | None:
        """Start the work (the loop's thread) once its admission is granted: :meth:`advance`
        from its beginning; ``None`` when it was withdrawn, is already done, or waits for room
        (:attr:`awaiting_admission` then holds).

        Raises:
            Exception: What its admission raised (it took nothing).
        """
        with self._claim:  # granted and started together: a withdrawal never strands a grant
            if self.future.done():
                return None
            if self.admission is not None and not self.admission.try_grant():
                self.refused = True
                return None
            self.started, self.refused = True, False
        return self.advance(None)

    @property
    def awaiting_admission(self) -> bool:
        """Whether it waits for its admission (not started, not withdrawn)."""
        return self.admission is not None and not self.started and not self.future.done()

    @property
    def finished(self) -> bool:
        """Whether its future is settled."""
        return self.future.done()

    @property
    def cancelled(self) -> bool:
        """Whether its request was cancelled."""
        return self.cancellation is not None and self.cancellation.cancelled

    def advance(self, reply: Any = None) -> TokenPass | ModelCall | JoinDecode | None:
        """Send ``reply``, run its host work up to its next request and return that request;
        ``None`` once it is done (its future settled)."""
        try:
            with stage_times.recording_into(self.recording):
                request = self.steps.send(reply)
        except StopIteration as stop:
            self.request = None
            self.future.set_result(stop.value)
            return None
        except Exception as exc:  # noqa: BLE001 - the work's own failure, re-raised by its caller
            self.request = None
            self.future.set_exception(exc)
            return None
        if not isinstance(request, (TokenPass, ModelCall, JoinDecode)):
            self.fail(TypeError(f"prompt work yielded {type(request).__name__}, not a pass the engine loop runs"))
            return None
        self.request, self._done = request, 0
        return request

    def next_slice(self, budget: int) -> Segment:
        """The next slice of its :class:`TokenPass`: at most ``budget`` tokens (at least one)."""
        request = self.request
        assert isinstance(request, TokenPass), "a slice of a work that waits for no token pass"
        segment = request.slice_after(self._done, budget)
        self._stop = self._done + len(segment)
        return segment

    def slice_ran(self, output: SegmentOutput) -> PassResult | None:
        """Account for the slice :meth:`next_slice` gave; the pass's result once it is whole."""
        request = self.request
        assert isinstance(request, TokenPass)
        self._done = self._stop
        if self._done < len(request):
            return None
        return PassResult.of_last_slice(output)

    def fail(self, error: BaseException) -> None:
        """End the work with ``error``: its generator is closed where it waits (its cleanup
        runs) and its future holds ``error``. A cleanup that raises is logged (rate-limited)
        and noted on ``error``; it never stops the caller (the loop goes on with the others)."""
        self.request = None
        try:
            close_quietly(self.steps, error)
        finally:
            with self._claim:
                if not self.future.done():
                    self.future.set_exception(error)


def close_quietly(steps: PassSteps[Any], error: BaseException | None = None) -> None:
    """Close a work's generator (its cleanup runs where it waits); an exception its cleanup
    raises is logged (rate-limited) and, when ``error`` is what ended the work, noted on it.

    Args:
        steps: The generator.
        error: What ended the work, if anything (the cleanup's failure is added as a note).
    """
    try:
        steps.close()
    except Exception as cleanup:  # noqa: BLE001 - one work's cleanup must not stop the loop
        _warnings.warning("work-cleanup-failed", "a prompt work's cleanup failed: %s: %s", type(cleanup).__name__, cleanup)
        logger.debug("the failed cleanup", exc_info=cleanup)
        if error is not None and error is not cleanup:
            error.add_note(f"its cleanup then failed too: {type(cleanup).__name__}: {cleanup}")
