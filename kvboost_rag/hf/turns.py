"""The model's turns: prompt work (prefill, warming) and decode steps share one model.

Prompt work has priority: the decode worker does not take the model for a step while a
prefill holds it or waits for it, so a new request reaches its first token without waiting for
the running ones to finish. A prefill is long, though (about a second for 2k tokens of the
embedded model on a 2-core CPU), and every open stream would pause that long. So prompt work
runs in slices (chunks of tokens, decoder layers: :mod:`kvboost_rag.hf.passes`) and calls
:meth:`ModelTurns.between_chunks` between two of them; there, once the waiting decode step has
waited about ``max_decode_wait`` of its own duration (what the next slice would add
included), the model is lent to it for that one step and comes back to the same prompt work.
An open stream then pauses for about ``1 + max_decode_wait`` decode steps while a prompt is
prefilled, whatever its length. When more prompts wait for the model behind the one being
prefilled (a burst of requests), the decode step waits that many times longer: each lent
step is a forward pass of its own that delays every prompt in line, so a burst reaches its
first tokens about as soon as without interleaving, and a stream pauses in proportion to the
prompts queued instead of for all their prefills.

A boundary is also where prompt work sees its request's cancellation
(:class:`~kvboost_rag.cancellation.Cancellation`): a cancelled request stops there, and
one still waiting for its turn stops waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvboost_rag.cancellation import Cancellation, wait_while

#: Weight of the newest decode step in the running mean of step durations.
STEP_SMOOTHING = 0.3


class ModelTurns:
    """The model's lock: prompt work first, decode steps lent turns at its slice boundaries.

    Re-entrant for prompt work (a warm inside a warm). Safe to use from any thread.

    Args:
        max_decode_wait: How long a waiting decode step may wait for prompt work, as a share
            of a decode step's duration (a running mean of the steps run): ``0`` lends it
            the model at the first boundary; read at every boundary (a callable reads a
            setting that may change).
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        max_decode_wait: float | Callable[[], float] = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._max_wait = max_decode_wait if callable(max_decode_wait) else (lambda: max_decode_wait)
        self._clock = clock
        self._state = threading.Condition()
        self._holder: int | None = None
        self._cancellations: list[Cancellation | None] = []
        self._prompt_waiting = 0
        self._decode_waiting = 0
        self._decode_wait_start = 0.0
        self._decoding = False
        self._lent = False
        self._slice_start = 0.0
        self._step_seconds: float | None = None
        #: Decode steps run on a turn lent by prompt work (for tests and benchmarks).
        self.lent_steps = 0

    @contextmanager
    def prompt_work(self, cancellation: Cancellation | None = None) -> Iterator[None]:
        """Hold the model for prefill or warming; decode steps wait while this is asked for,
        except the steps lent at :meth:`between_chunks`.

        Args:
            cancellation: The request's: waiting for the turn ends when it is set, and the
                work's boundaries raise once it is.

        Raises:
            RequestCancelled: ``cancellation`` was set before the turn came.
        """
        me = threading.get_ident()
        with self._state:
            if self._holder != me:
                self._wait_for_turn(me, cancellation)
            self._cancellations.append(cancellation)
        try:
            yield
        finally:
            with self._state:
                self._cancellations.pop()
                if not self._cancellations:
                    self._holder = None
                    self._state.notify_all()

    def between_chunks(self) -> None:
        """A boundary of the prompt work this thread holds: raise if its request was
        cancelled, and lend the model to a decode step that has waited long enough (back
        once that step is over). Elsewhere (no prompt work held here): nothing.

        Raises:
            RequestCancelled: The prompt work's request was cancelled.
        """
        now = self._clock()
        with self._state:
            if self._holder != threading.get_ident():
                return
            self._check_cancelled()
            if self._should_lend(now):
                self._lent = True
                self._state.notify_all()
                while self._lent:
                    self._state.wait()
                self._check_cancelled()
            self._slice_start = self._clock()

    @contextmanager
    def decode_step(self) -> Iterator[None]:
        """Hold the model for one decode step, once no prompt work holds or waits for it, or
        when prompt work lends it at a boundary."""
        with self._state:
            if not self._decode_waiting:
                self._decode_wait_start = self._clock()
            self._decode_waiting += 1
            try:
                while not self._free_for_decode():
                    self._state.wait()
            finally:
                self._decode_waiting -= 1
            self._decoding = True
            borrowed = self._lent
        start = self._clock()
        try:
            yield
        finally:
            took = self._clock() - start
            with self._state:
                self._decoding = False
                if borrowed:
                    self._lent = False
                    self.lent_steps += 1
                previous = self._step_seconds
                self._step_seconds = took if previous is None else previous + STEP_SMOOTHING * (took - previous)
                self._state.notify_all()

    @property
    def step_seconds(self) -> float | None:
        """Running mean of the decode steps' durations (``None`` before the first)."""
        return self._step_seconds

    def _wait_for_turn(self, me: int, cancellation: Cancellation | None) -> None:
        """Wait (holding ``_state``) until the model is free, then take it for ``me``."""
        self._prompt_waiting += 1
        try:
            wait_while(self._state, lambda: self._holder is not None or self._decoding, cancellation)
        finally:
            self._prompt_waiting -= 1
        self._holder = me
        self._slice_start = self._clock()

    def _check_cancelled(self) -> None:
        for cancellation in self._cancellations:
            if cancellation is not None:
                cancellation.check()

    def _free_for_decode(self) -> bool:
        if self._decoding:
            return False
        if self._lent:
            return True
        return self._holder is None and not self._prompt_waiting

    def _should_lend(self, now: float) -> bool:
        """Whether a waiting decode step would wait too long if the next slice ran first: its
        wait so far plus the last slice's duration reach ``max_decode_wait`` steps, times one
        plus the prompts waiting for the model behind this one."""
        if not self._decode_waiting or self._lent:
            return False
        step = self._step_seconds
        if step is None:
            return True
        waited = now - self._decode_wait_start
        next_slice = now - self._slice_start
        return waited + next_slice >= self._max_wait() * step * (1 + self._prompt_waiting)
