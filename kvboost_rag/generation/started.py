"""A request between its hand-over to the engine loop and its end.

:class:`Pending` is a request whose prompt work the loop admits and runs; :meth:`Pending.wait`
gives the :class:`Request` once its first token is chosen (its work gave back all it held when
it failed or was cancelled first). :func:`drain` lets a request that will not be followed go.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from kvboost_rag.cancellation import Cancellation
from kvboost_rag.decode.handle import DecodeHandle
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.engine_loop import Admission, BatchPlaces, Reservation
from kvboost_rag.generation.request_work import Started
from kvboost_rag.generation.slots import Lease
from kvboost_rag.hf.passes import PassSteps
from kvboost_rag.prefill.outcome import PrefillOutcome
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import PromptPlan


@dataclass
class Request:
    """One prompt of ``generate``/``stream``/``generate_batch`` from its prefill to its result.

    Attributes:
        plan: Its plan.
        options: Its options.
        start: ``perf_counter`` at the call (TTFT is measured from here).
        outcome: Its prefill outcome (write-back reads it).
        sequence: Its decode state.
        ttft_ms: Wall time from the call to its first token.
        first_pieces: Text of the first token, not yielded yet.
        reservation: Its place in the batch while its sequence has not joined the running
            batch (a first token that ended it; once joined, the loop gives it back).
        handle: Its sequence's pieces, once it joined the running batch.
        lease: Its K/V buffers on loan: a slot of the captured steps' pool, or buffers of the
            host buffer pool (``None``: buffers of its own).
        cancellation: The call's cancellation: once set, its sequence leaves the batch.
        unwatch: Stops its cancellation from watching the handle (once it closed).
        counted: Stops the batch counting its buffers' bytes (called once its buffers are
            handed on or given back).
    """

    plan: PromptPlan
    options: GenerationOptions
    start: float
    outcome: PrefillOutcome
    sequence: DecodeSequence
    ttft_ms: float
    first_pieces: list[str]
    reservation: Reservation | None = None
    handle: DecodeHandle | None = None
    lease: Lease | None = None
    cancellation: Cancellation | None = None
    unwatch: Callable[[], None] | None = None
    counted: Callable[[], None] | None = None

    def close(self, places: BatchPlaces) -> None:
        """Give its place back: out of the batch at the next step if it is still decoding."""
        if self.reservation is not None:
            places.release(self.reservation)
            self.reservation = None
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.cancel()
        if self.unwatch is not None:
            unwatch, self.unwatch = self.unwatch, None
            unwatch()  # the cancellation (a batch's, an async bridge's) outlives the request

    def release_slot(self) -> None:
        """The request is done reading its buffers (again, or once handed to the write-back:
        nothing); the batch no longer counts their bytes."""
        self._stop_counting()
        if self.lease is not None:
            self.lease.release("request")

    def release_slot_later(self) -> Callable[[], None] | None:
        """What releases the request's hold on its buffers, for whoever reads them last (the
        write-back); ``None`` without a lease. The batch goes on counting their bytes until
        :meth:`release_slot` (once the write-back's queue took the job and counts them)."""
        lease = self.lease
        return None if lease is None else partial(lease.release, "request")

    def _stop_counting(self) -> None:
        stop, self.counted = self.counted, None
        if stop is not None:
            stop()


@dataclass
class Pending:
    """A request whose prompt work the engine loop runs; :meth:`wait` gives the request.

    Attributes:
        plan: Its plan.
        options: Its options.
        start: ``perf_counter`` at the call.
        steps: Its prompt work, until it is handed to the loop.
        admission: Its place and buffers, granted by the loop before the work starts.
        cancellation: The call's cancellation.
        future: The prompt work's future (a :class:`Started`), once handed to the loop.
    """

    plan: PromptPlan
    options: GenerationOptions
    start: float
    steps: PassSteps[Started] | None
    admission: Admission[tuple[Reservation, Lease | None]]
    cancellation: Cancellation
    future: Future | None = None

    def wait(self, places: BatchPlaces) -> Request:
        """The request once its first token is chosen (when it failed or was cancelled first,
        its work gave back all it held).

        Raises:
            RequestCancelled: The call was cancelled before its first token.
            Exception: What ended its prompt work.
        """
        assert self.future is not None, "wait for a request handed to the engine loop"
        started: Started = _settled(self.future, self.cancellation)
        joined, reservation, lease = started.handle is not None, started.reservation, started.lease
        request = Request(
            self.plan, self.options, self.start, started.outcome, started.sequence,
            (started.first_token_at - self.start) * 1000, started.first_pieces,
            None if joined else reservation, started.handle, lease, self.cancellation,
            counted=None if lease is not None else partial(places.release_bytes, reservation),
        )
        if joined:
            request.unwatch = self.cancellation.watch(started.handle.cancel)
        else:
            request.close(places)
        return request


def _settled(future: Future, cancellation: Cancellation):
    """The future's result; an interrupted wait cancels the work and waits until the loop
    dropped it (its buffers may go back only then)."""
    try:
        return future.result()
    except BaseException:
        if not future.done():
            cancellation.cancel()
            future.exception()
        raise


def drain(waiting: Pending, places: BatchPlaces) -> None:
    """Let a request that will not be followed go (its work is cancelled): its place and
    buffers go back once the loop dropped it (or it reached its first token)."""
    try:
        request = waiting.wait(places)
    except BaseException:  # noqa: BLE001 - cancelled or failed: already given back
        return
    request.close(places)
    request.release_slot()
