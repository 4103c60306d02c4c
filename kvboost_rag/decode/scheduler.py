"""Continuous batching: concurrent requests share every decode step.

Each request prefills in its caller's thread, then hands its sequence to the
:class:`DecodeScheduler`. One worker thread runs the decode steps: every step feeds all
running sequences through the model in one forward pass
(:func:`~kvboost_rag.decode.step.decode_step`); a sequence handed over while others decode
joins at the next step, and a finished one leaves. Text pieces go back to each request
through its own queue, so a stream yields per request.

Admission is first come, first served: a request reserves its place before its prefill
(:meth:`DecodeScheduler.reserve`) and waits while the batch holds ``max_batch_size``
sequences, or while its K/V buffers would take the sequences' buffers past
``max_batch_cache_bytes`` (one request is always admitted when none runs, however large). A
reservation is given back when its sequence leaves the batch.

:class:`~kvboost_rag.hf.turns.ModelTurns` serializes the model between prompt work
(prefill, warming) and decode steps: prompt work first, decode steps lent a turn between its
slices, so open streams keep going while a prompt is prefilled.

A request's :class:`~kvboost_rag.cancellation.Cancellation` reaches it here at every
stage: waiting for a place (:meth:`DecodeScheduler.reserve` raises), and decoding (its
sequence leaves the batch at the next step, and its reader stops waiting for pieces).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

from kvboost_rag.cancellation import Cancellation, wait_while
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.decode.step import DecodeSequence, FinishReason, StepResult
from kvboost_rag.errors import RequestCancelled
from kvboost_rag.hf.turns import ModelTurns

__all__ = ["DecodeHandle", "DecodeScheduler", "Reservation"]


@dataclass(eq=False)
class Reservation:
    """A request's place in the batch, held from before its prefill until it leaves.

    Attributes:
        nbytes: Bytes of the K/V buffers its sequence holds.
        on_release: Called once when the place is given back (the scheduler no longer steps
            its sequence): what the sequence's steps used may be handed on.
    """

    nbytes: int
    released: bool = False
    on_release: list[Callable[[], None]] = field(default_factory=list)


@dataclass(eq=False)
class DecodeHandle:
    """A request's view of its sequence while the worker decodes it."""

    sequence: DecodeSequence
    reservation: Reservation
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def pieces(self) -> Generator[str, None, FinishReason]:
        """Text pieces as the worker decodes them; returns the finish reason.

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
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._events.put(("cancelled", None))

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def _ends_with(self, result: StepResult) -> bool:
        """Whether the sequence is over after this step's result."""
        return result.error is not None or self.sequence.done

    def _deliver(self, result: StepResult) -> None:
        """Post a step's result to the request."""
        for piece in result.pieces:
            self._events.put(("piece", piece))
        if result.error is not None:
            self._events.put(("error", result.error))
        elif self.sequence.done:
            self._events.put(("done", self.sequence.finish_reason))


class DecodeScheduler:
    """Runs the decode steps of every request in one batch (continuous batching).

    Args:
        step: Runs one decode step over a list of sequences (:func:`decode_step` bound to
            the model adapter).
        turns: The model's lock shared with prefill and warming.
        settings: Engine settings: ``max_batch_size`` (most sequences admitted at once) and
            ``max_batch_cache_bytes`` (most bytes of K/V buffers they hold together), read at
            every admission.
    """

    def __init__(
        self,
        step: Callable[[list[DecodeSequence]], list[StepResult]],
        turns: ModelTurns,
        settings: KVBoostSettings,
    ) -> None:
        self._step = step
        self._turns = turns
        self._settings = settings
        self._state = threading.Condition()
        self._waiting: deque[Reservation] = deque()
        self._admitted = 0
        self._admitted_bytes = 0
        self._incoming: list[DecodeHandle] = []
        self._worker: threading.Thread | None = None
        #: Largest number of sequences one step has decoded (for tests and benchmarks).
        self.peak_batch = 0

    @property
    def admitted(self) -> int:
        """Requests holding a place now (prefilling or decoding)."""
        with self._state:
            return self._admitted

    def reserve(
        self,
        nbytes: int,
        on_wait: Callable[[], None] | None = None,
        cancellation: Cancellation | None = None,
    ) -> Reservation:
        """Wait, in arrival order, for a place in the batch for a sequence of ``nbytes``.

        Args:
            nbytes: Bytes of the K/V buffers its prefill allocates.
            on_wait: Called once (without the scheduler's lock) if there is no place now,
                before waiting for one (a batch hands over the sequences it holds back).
            cancellation: The request's: once set, it leaves the line.

        Raises:
            RequestCancelled: ``cancellation`` was set before a place came.
        """
        reservation = Reservation(nbytes)
        with self._state:
            self._waiting.append(reservation)
            ready = self._waiting[0] is reservation and self._fits(nbytes)
        try:
            if not ready and on_wait is not None:
                on_wait()
            with self._state:
                wait_while(self._state, lambda: self._waiting[0] is not reservation or not self._fits(nbytes), cancellation)
        except BaseException:  # interrupted while waiting: leave the line
            with self._state:
                self._waiting.remove(reservation)
                self._state.notify_all()
            raise
        with self._state:
            self._waiting.popleft()
            self._admitted += 1
            self._admitted_bytes += nbytes
            self._state.notify_all()
        return reservation

    def release(self, reservation: Reservation) -> None:
        """Give a place back (once; later calls do nothing)."""
        with self._state:
            self._release_locked(reservation)

    def submit_many(self, entries: Sequence[tuple[DecodeSequence, Reservation]]) -> list[DecodeHandle]:
        """Like :meth:`submit` for several sequences that join the same step."""
        handles = [DecodeHandle(sequence, reservation) for sequence, reservation in entries]
        with self._state:
            self._incoming.extend(handles)
            if handles and self._worker is None:
                # Not a daemon: at interpreter exit Python joins it once the running sequences
                # are done, so it never frees tensors while the interpreter tears down.
                self._worker = threading.Thread(target=self._run, name="kvboost-decode")
                self._worker.start()
        return handles

    def _fits(self, nbytes: int) -> bool:
        if self._admitted >= self._settings.max_batch_size:
            return False
        return self._admitted == 0 or self._admitted_bytes + nbytes <= self._settings.max_batch_cache_bytes

    def _run(self) -> None:
        """The worker: one step over every running sequence until none is left."""
        running: list[DecodeHandle] = []
        try:
            self._loop(running)
        except BaseException as exc:  # the worker itself failed: no request may wait forever
            with self._state:
                orphans = running + self._incoming
                self._incoming.clear()
                for handle in orphans:
                    self._release_locked(handle.reservation)
                self._worker = None
            for handle in orphans:
                handle._deliver(StepResult(error=exc))
            raise

    def _loop(self, running: list[DecodeHandle]) -> None:
        """Admit what was handed over, drop what was cancelled, run one step, deliver; until
        nothing runs (the worker then exits, and the next hand-over starts a new one)."""
        while True:
            with self._state:
                joining = list(self._incoming)
                running.extend(joining)
                self._incoming.clear()
                for handle in [h for h in running if h.cancelled]:
                    running.remove(handle)
                    self._release_locked(handle.reservation)
                if not running:
                    self._worker = None
                    return
            self._prepare(running, [handle for handle in joining if handle in running])
            if not running:
                continue
            self.peak_batch = max(self.peak_batch, len(running))
            try:
                with self._turns.decode_step():
                    results = self._step([handle.sequence for handle in running])
            except Exception as exc:  # noqa: BLE001 - the step failed for every sequence in it; each caller re-raises
                results = [StepResult(error=exc) for _ in running]
            stepped = list(zip(running, results))
            finished = [handle for handle, result in stepped if handle._ends_with(result)]
            if finished:  # places are given back before the requests hear they are done
                with self._state:
                    for handle in finished:
                        running.remove(handle)
                        self._release_locked(handle.reservation)
            for handle, result in stepped:
                handle._deliver(result)

    def _prepare(self, running: list[DecodeHandle], joining: list[DecodeHandle]) -> None:
        """Run the work each joining sequence asked for before its first step; a sequence
        whose work fails leaves with the error."""
        for handle in joining:
            work, handle.sequence.before_first_step = handle.sequence.before_first_step, None
            if work is None:
                continue
            try:
                with self._turns.decode_step():
                    work()
            except Exception as exc:  # noqa: BLE001 - this request's caller re-raises it
                with self._state:
                    running.remove(handle)
                    self._release_locked(handle.reservation)
                handle._deliver(StepResult(error=exc))

    def _release_locked(self, reservation: Reservation) -> None:
        if not reservation.released:
            reservation.released = True
            self._admitted -= 1
            self._admitted_bytes -= reservation.nbytes
            for callback in reservation.on_release:
                callback()
            self._state.notify_all()
