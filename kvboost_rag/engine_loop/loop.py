"""The engine loop: one thread owns the model and builds every forward pass.

Requests, warming and batches put prompt work on the loop (:meth:`EngineLoop.submit`: a
generator of the passes it needs, see :mod:`kvboost_rag.engine_loop.work`) and wait on its
future; a request's sequence, once its first token is chosen, joins the running batch and its
text pieces reach the request through its :class:`~kvboost_rag.decode.handle.DecodeHandle`.
Nothing else runs the model while the loop does, so nothing is paused mid-pass, lent or
swapped.

Admission is the loop's decision (as vLLM's scheduler allocates a request's blocks when it
schedules it): a request's prompt work arrives with an
:class:`~kvboost_rag.engine_loop.work.Admission` (its place in the batch and its K/V buffers)
and waits in the loop's queue, holding nothing, until the loop grants it, in arrival order, when
there is room (:class:`~kvboost_rag.engine_loop.places.BatchPlaces`); a work whose admission
waits holds back the admission of every later one. While only such work waits, the thread
sleeps until room is given back.

Each step (as vLLM's engine core schedules one: running requests first, then waiting prompt
work up to a token budget, one forward pass):

1. drop the work and sequences whose request was cancelled (their places go back);
2. plan the running sequences' rows: each one's pending token and its draft
   (:class:`~kvboost_rag.decode.step.DecodeRows`);
3. fill the step's prompt budget (:class:`~kvboost_rag.engine_loop.budget.StepBudget`) with
   slices of waiting prompt work, oldest first, one slice per work (a prefill chunk, the
   repair's probe or blend pass, a document being warmed), admitting and starting new work as
   the budget reaches it; the oldest work that waits for a pass that runs whole
   (:class:`~kvboost_rag.hf.passes.ModelCall`) gets it after the packed pass;
4. run the rows and the slices as one packed forward pass
   (:meth:`~kvboost_rag.hf.adapter.ModelAdapter.forward_segments`); sequences that decode
   through captured steps (CUDA) run there;
5. hand each sequence its tokens (finished ones leave, their places given back) and each
   slice's result to its work, which runs its host work up to its next pass.

Faults stay with the request they belong to (as vLLM's engine core aborts one request and
goes on): a pass that fails is run again segment by segment, so an error ends only the work or
sequence it belongs to; so does an exception in one request's host work, its draft planning
(its drafter, its constraint's check of a draft), the preparation of its slice, its cache's
length read before the pass, a callback run when its place goes back, or its work's cleanup:
that request ends with its error (its place given back, its reader told) and the others go on
unchanged. Only a fault of the loop itself (outside any one request) ends everything it holds
(:meth:`EngineLoop._fail_everything`): every future and every reader is settled, even when a
cleanup raises, and work queued meanwhile goes to a fresh thread.

The thread starts with the first work and ends once nothing is left for
:data:`LINGER_SECONDS` (it is not a daemon: at interpreter exit it finishes what it holds
before the interpreter tears down); as it ends, and before it lets the loop go, it hands the C
heaps' free memory back to the system (:func:`kvboost_rag.c_heap.trim`: the passes'
temporaries, freed but kept by the allocator, would otherwise let resident memory creep up
under a steady load). In a process forked from this one the loop starts afresh with the next
work (:mod:`kvboost_rag.forking`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvboost_rag import c_heap, forking
from kvboost_rag.cancellation import Cancellation
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.decode.draft_policy import DraftPolicy
from kvboost_rag.decode.handle import DecodeHandle
from kvboost_rag.decode.step import DecodeRows, StepResult
from kvboost_rag.engine_loop.budget import MIN_SLICE, StepBudget
from kvboost_rag.engine_loop.places import BatchPlaces
from kvboost_rag.engine_loop.work import Admission, JoinDecode, PromptWork
from kvboost_rag.errors import RequestCancelled
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.caches import truncate_cache
from kvboost_rag.hf.captured import CapturedRows
from kvboost_rag.hf.packed import Segment, SegmentOutput
from kvboost_rag.hf.passes import ModelCall, PassSteps, TokenPass
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.openmp_workers import release_idle_workers

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

T = TypeVar("T")
#: The loop thread's name.
LOOP_THREAD = "kvboost-engine"
#: How long the loop's thread waits for more work once nothing is left, before it ends (so a
#: call right after another does not start a new thread; at interpreter exit this is all it
#: holds the exit up).
LINGER_SECONDS = 0.2
#: Longest sleep while only work awaiting admission is queued (room given back wakes it sooner).
ADMISSION_WAIT_SECONDS = 0.05


class EngineLoop:
    """The thread that runs every forward pass of one engine.

    Args:
        adapter: The model adapter.
        settings: Engine settings (the step budget's ``max_decode_wait`` and
            ``prefill_chunk_tokens``).
        places: The batch's places (given back here when a sequence leaves).
        policy: Chooses draft lengths (``None``: no drafts).
        captured: Captured decode steps the sequences with a slot run through (CUDA).
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        settings: KVBoostSettings,
        places: BatchPlaces,
        policy: DraftPolicy | None = None,
        captured: CapturedRows | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._adapter, self._places, self._policy, self._captured = adapter, places, policy, captured
        self._clock = clock
        self.budget = StepBudget(settings, adapter.device.type)
        self._lock = threading.Condition()
        self._incoming: list[PromptWork] = []
        self._room_given = False  # room given back since the loop last slept for it
        self._thread: threading.Thread | None = None
        # Touched by the loop's thread only:
        self._works: list[PromptWork] = []
        self._running: list[DecodeHandle] = []
        self._after: dict[PromptWork, DecodeHandle] = {}  # work before a sequence's first step -> its sequence
        #: Steps run so far (all kinds).
        self.steps = 0
        #: Most sequences one step has decoded.
        self.peak_batch = 0
        places.listen(self.wake)
        forking.register(self)

    # ------------------------------------------------------------------ submitting work
    def submit(
        self, steps: PassSteps[T], cancellation: Cancellation | None = None, *, request: bool = False,
        admission: Admission | None = None,
    ) -> Future:
        """Queue prompt work; its future settles with what it returns or the error that
        ended it (:class:`~kvboost_rag.errors.RequestCancelled` once ``cancellation`` is set).

        Args:
            steps: The work.
            cancellation: Its request's cancellation.
            request: It is a request's way to its first token (its user waits): while several
                wait, steps carry more of their prompts (see :mod:`kvboost_rag.engine_loop.budget`).
            admission: The memory it must be granted before it starts (``None``: none).

        Raises:
            RuntimeError: Called from the loop's own thread (it would wait for itself).
        """
        return self.submit_many([(steps, cancellation)], request=request, admissions=[admission])[0]

    @staticmethod
    def _work(
        steps: PassSteps[Any], cancellation: Cancellation | None, request: bool, admission: Admission | None
    ) -> PromptWork:
        work = PromptWork(steps, cancellation, urgent=request, admission=admission)
        if cancellation is not None:  # cancelled before the loop starts it: withdrawn at once
            unwatch = cancellation.watch(work.withdraw)
            work.future.add_done_callback(lambda _: unwatch())
        return work

    def _enqueue(self, works: list[PromptWork]) -> None:
        """Hand works to the loop's thread (started if it is not running). The caller's idle
        OpenMP workers are given back first: while they exist the loop's own workers sleep
        between parallel regions (:mod:`kvboost_rag.openmp_workers`)."""
        release_idle_workers()
        with self._lock:
            self._incoming.extend(works)
            self._lock.notify()
            if self._thread is None:
                self._start_thread()

    def _start_thread(self) -> None:
        """Start the loop's thread (under the lock; none runs)."""
        self._thread = threading.Thread(target=self._run, name=LOOP_THREAD, daemon=False)
        self._thread.start()

    def submit_many(
        self, works: Sequence[tuple[PassSteps[Any], Cancellation | None]], *, request: bool = False,
        admissions: Sequence[Admission | None] | None = None,
    ) -> list[Future]:
        """:meth:`submit` of several pieces of work at once (``admissions``: each one's, in
        order): the loop sees them together, so their first passes share its next step."""
        if threading.current_thread().name == LOOP_THREAD and self._owns_current_thread():
            for steps, _ in works:
                steps.close()
            raise RuntimeError("work submitted from the engine loop's own thread would wait for itself")
        admissions = list(admissions) if admissions is not None else [None] * len(works)
        made = [self._work(steps, cancellation, request, a) for (steps, cancellation), a in zip(works, admissions)]
        self._enqueue(made)
        return [work.future for work in made]

    def wake(self) -> None:
        """Room may have been given back: work awaiting admission is tried at once (any thread;
        given while the loop is between a refusal and its sleep, the sleep is skipped)."""
        with self._lock:
            self._room_given = True
            self._lock.notify()

    def run(self, steps: PassSteps[T], cancellation: Cancellation | None = None) -> T:
        """:meth:`submit` and wait for the result (raises what ended the work)."""
        return self.submit(steps, cancellation).result()

    def run_all(self, works: Sequence[PassSteps[Any]], cancellation: Cancellation | None = None) -> list[Any]:
        """Queue several pieces of work at once (the loop packs their passes together) and
        wait for them all: each one's result, or the exception that ended it."""
        futures = self.submit_many([(steps, cancellation) for steps in works])
        outcomes: list[Any] = []
        for future in futures:
            error = future.exception()
            outcomes.append(error if error is not None else future.result())
        return outcomes

    def _owns_current_thread(self) -> bool:
        with self._lock:
            return self._thread is threading.current_thread()

    @property
    def queued(self) -> int:
        """Pieces of work submitted and not started yet (an estimate from another thread)."""
        with self._lock:
            works = self._incoming + self._works
        return sum(1 for work in works if not work.started and not work.finished)

    @property
    def waiting(self) -> int:
        """Requests whose work awaits admission (an estimate from another thread)."""
        with self._lock:
            works = self._incoming + self._works
        return sum(1 for work in works if work.awaiting_admission)

    @property
    def decoding(self) -> int:
        """Sequences in the running batch now (an estimate from another thread)."""
        return len(self._running)

    @property
    def active(self) -> bool:
        """Whether the loop's thread is running."""
        with self._lock:
            return self._thread is not None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as exc:  # the loop itself failed: nobody may wait forever
            logger.exception("the engine loop failed; its work and sequences end with the error")
            self._fail_everything(exc)
            raise

    def _fail_everything(self, error: BaseException) -> None:
        """End every work and sequence this thread holds with ``error`` (the loop itself
        failed): each one is settled even when another's cleanup or release raises. The thread
        is let go only once they all are, so a loop started again never has its own work swept
        here; work queued meanwhile goes to a fresh thread."""
        with self._lock:
            works, self._incoming = self._works + self._incoming, []
        handles = self._running + list(self._after.values())
        self._works, self._running, self._after = [], [], {}
        for work in works:
            try:
                if not work.finished:
                    work.fail(error)
            except BaseException:  # noqa: BLE001 - the next ones are settled all the same
                logger.exception("failing a work after the loop's fault raised")
        for handle in handles:
            try:
                self._end(handle, StepResult(error=error))
            except BaseException:  # noqa: BLE001 - the next ones are settled all the same
                logger.exception("ending a sequence after the loop's fault raised")
        with self._lock:
            self._thread = None
            if self._incoming:  # queued while this thread settled the rest
                self._start_thread()

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's thread is gone, its lock may be held, and the
        callers of the work it held are not here. Start afresh: the next work starts a thread."""
        self._lock = threading.Condition()
        self._incoming, self._works, self._running, self._after = [], [], [], {}
        self._thread = None

    def _step(self) -> bool:
        """One step; ``False`` once nothing is left for :data:`LINGER_SECONDS` (the thread
        then ends)."""
        with self._lock:
            if not self._incoming and not self._works and not self._running:
                release_idle_workers()  # idle: its workers would slow the threads that run torch meanwhile
                self._lock.wait(LINGER_SECONDS)  # a call right after the last one keeps the thread
            self._works += self._incoming
            self._incoming.clear()
            idle = not self._works and not self._running
        if idle:
            return not self._ended_after_trim()
        start = self._clock()
        self._drop_cancelled()
        rows = self._plan_rows()
        requests = sum(1 for work in self._works if work.urgent and not work.finished and not work.refused)
        call = self._model_call_due()
        slices = self._slices(self._prompt_budget(rows))
        if rows is None and not slices and call is None and any(work.awaiting_admission for work in self._works):
            self._await_room()  # nothing else to run: only work that waits for room is queued
            return True
        self._run_pass(rows, slices)
        if call is not None:
            self._run_call(call)
        self.steps += 1
        self._works = [work for work in self._works if not work.finished]
        if call is None:
            prompt_tokens = sum(len(segment) for _, segment in slices)
            self.budget.record(rows.packed_rows if rows is not None else 0, prompt_tokens, self._clock() - start, requests)
        return True

    def _ended_after_trim(self) -> bool:
        """Idle for a linger: hand the C heaps' free memory back while this thread still owns
        the loop (so no other thread's pass runs beside the trim), then let the thread go
        unless work came in meanwhile (this thread runs it). ``True`` once the thread is let go."""
        c_heap.trim()
        with self._lock:
            if self._incoming:
                return False
            self._thread = None
            return True

    def _await_room(self) -> None:
        """Nothing to run (what is queued awaits admission): sleep until room is given back,
        new work arrives or :data:`ADMISSION_WAIT_SECONDS` pass (the step is not recorded)."""
        self._works = [work for work in self._works if not work.finished]
        with self._lock:
            if not self._incoming and not self._room_given:
                self._lock.wait(ADMISSION_WAIT_SECONDS)
            self._room_given = False

    def _prompt_budget(self, rows: DecodeRows | None) -> int:
        """Prompt tokens this step carries beside ``rows``."""
        if rows is None:
            return self.budget.prompt_tokens(0, 0)
        return self.budget.prompt_tokens(rows.packed_rows, rows.packed_tokens)

    def _plan_rows(self) -> DecodeRows | None:
        """The running sequences' rows of this step, each with the draft its policy chose
        (shorter while prompt work waits, as the budget says)."""
        if not self._running:
            return None
        row_tokens = self.budget.row_tokens(any(not work.finished for work in self._works))
        rows = DecodeRows.plan([handle.sequence for handle in self._running], self._policy, self._captured, row_tokens)
        if rows.failed:  # their draft planning raised: they leave, each with its own error
            handles = {id(handle.sequence): handle for handle in self._running}
            for sequence, error in rows.failed:
                self._leave(handles[id(sequence)], StepResult(error=error))
        return rows if rows.sequences else None

    # ------------------------------------------------------------------ choosing the step's work
    def _drop_cancelled(self) -> None:
        """End the work and sequences whose request was cancelled."""
        for work in self._works:
            if work.cancelled and not work.finished:
                self._fail(work, RequestCancelled("the request was cancelled"))
        for handle in [h for h in self._running if h.cancelled]:
            self._running.remove(handle)
            self._give_back(handle)

    def _model_call_due(self) -> tuple[PromptWork, ModelCall] | None:
        """The oldest started work that waits for a pass that runs whole (after the step's
        packed pass; one a step)."""
        for work in self._works:
            if work.started and not work.finished and isinstance(work.request, ModelCall):
                return work, work.request
        return None

    def _slices(self, budget: int) -> list[tuple[PromptWork, Segment]]:
        """Slices of the waiting token passes, oldest work first, one per work, within
        ``budget`` tokens; new work is admitted and started (its host work run) as the budget
        reaches it, in arrival order: once one awaits admission, no later one is admitted in
        this step (a work that asks for a pass that runs whole waits for the next step's)."""
        slices: list[tuple[PromptWork, Segment]] = []
        left = budget
        held_back = False  # an earlier work awaits admission
        for work in self._works:
            if left < MIN_SLICE and slices:
                break
            if not work.started and not (held_back and work.admission is not None):
                self._start(work)
            held_back = held_back or work.awaiting_admission
            if work.finished or not isinstance(work.request, TokenPass):
                continue
            try:
                segment = work.next_slice(max(left, 1))  # its rows prepared (zeroed) before a cut pass
            except Exception as exc:  # noqa: BLE001 - this work's own failure
                self._fail(work, exc)
                continue
            slices.append((work, segment))
            left -= len(segment)
        return slices

    # ------------------------------------------------------------------ running it
    def _run_pass(self, rows: DecodeRows | None, slices: list[tuple[PromptWork, Segment]]) -> None:
        """The step's packed pass: decode rows and prompt slices; results handed on."""
        row_segments = rows.segments() if rows is not None else []
        segments = row_segments + [segment for _, segment in slices]
        start = self._clock()
        outputs = self._forward(segments) if segments else []
        if rows is not None:
            self.peak_batch = max(self.peak_batch, len(rows.sequences))
            self._finish_rows(rows, outputs[: len(row_segments)])
            if not slices and self._policy is not None:  # the draft policy learns from decode-only steps
                self._policy.costs.record(len(rows.sequences), rows.width, self._clock() - start)
        for (work, _), output in zip(slices, outputs[len(row_segments) :]):
            if isinstance(output, BaseException):
                self._fail(work, output)
                continue
            try:
                result = work.slice_ran(output)
            except Exception as exc:  # noqa: BLE001 - this work's own failure
                self._fail(work, exc)
                continue
            if result is not None:
                self._advance(work, result)

    def _forward(self, segments: list[Segment]) -> list[SegmentOutput | BaseException]:
        """Every segment in one pass; if the pass fails, each segment alone, so a failure
        reaches only the segment it belongs to (so does a cache whose length cannot be read
        before the pass: its segment does not run)."""
        lengths = [_held_length(segment) for segment in segments]
        ready = [(segment, length) for segment, length in zip(segments, lengths) if not isinstance(length, Exception)]
        try:
            ran = list(self._adapter.forward_segments([segment for segment, _ in ready])) if ready else []
        except Exception:  # noqa: BLE001 - found out segment by segment below
            logger.debug("a packed pass failed; its segments run one by one", exc_info=True)
            ran = self._one_by_one(ready)
        outputs = iter(ran)
        return [length if isinstance(length, Exception) else next(outputs) for length in lengths]

    def _one_by_one(self, ready: list[tuple[Segment, Any]]) -> list[SegmentOutput | BaseException]:
        """Each segment in a pass of its own (after a packed pass failed), from the length its
        cache held before; a failure is that segment's output."""
        outputs: list[SegmentOutput | BaseException] = []
        for segment, length in ready:
            try:
                _restore_length(segment, length)
                outputs.append(self._adapter.forward_segments([segment])[0])
            except Exception as exc:  # noqa: BLE001 - handed to the segment's owner
                outputs.append(exc)
                try:
                    _restore_length(segment, length)
                except Exception:  # noqa: BLE001 - its owner already ends with ``exc``
                    logger.debug("restoring a failed segment's cache failed", exc_info=True)
        return outputs

    def _finish_rows(self, rows: DecodeRows, outputs: list[SegmentOutput | BaseException]) -> None:
        """Hand each running sequence its step: tokens chosen, pieces posted, finished
        sequences out of the batch (their places given back before their requests hear)."""
        handles = {id(handle.sequence): handle for handle in self._running}
        eager = [i for i, slotted in enumerate(rows.slotted) if not slotted]
        failed = {eager[k]: output for k, output in enumerate(outputs) if isinstance(output, BaseException)}
        kept = [i for i in range(len(rows.sequences)) if i not in failed]
        results: dict[int, StepResult] = {i: StepResult(error=error) for i, error in failed.items()}
        if kept:
            subset = rows.subset(kept)
            ok = [output for output in outputs if not isinstance(output, BaseException)]
            try:
                finished = subset.finish(ok, self._policy, self._captured)
            except Exception as exc:  # noqa: BLE001 - the step failed for every sequence in it
                finished = [StepResult(error=exc) for _ in kept]
            results.update(zip(kept, finished))
        for i, sequence in enumerate(rows.sequences):
            handle, result = handles[id(sequence)], results[i]
            if handle.ends_with(result):
                self._leave(handle, result)
            else:
                handle.deliver(result)

    def _run_call(self, due: tuple[PromptWork, ModelCall]) -> None:
        work, call = due
        try:
            reply = call.run()
        except Exception as exc:  # noqa: BLE001 - the work's own failure, re-raised by its caller
            self._fail(work, exc)
            return
        self._advance(work, reply)

    # ------------------------------------------------------------------ work and sequences
    def _start(self, work: PromptWork) -> None:
        """Start a work (unless it was withdrawn) and serve what it asks first; whatever
        raises there ends that work alone."""
        try:
            self._serve(work, work.start())
        except Exception as exc:  # noqa: BLE001 - this work's own failure
            self._fail(work, exc)

    def _advance(self, work: PromptWork, reply: Any) -> None:
        """Send a work its reply and serve what it asks next; whatever raises there ends that
        work alone."""
        try:
            self._serve(work, work.advance(reply))
        except Exception as exc:  # noqa: BLE001 - this work's own failure
            self._fail(work, exc)

    def _serve(self, work: PromptWork, request: Any) -> None:
        """Serve what a work asks that is not a pass (a sequence joining the batch); a work
        that ran before a sequence's first step lets it in once it is done."""
        while isinstance(request, JoinDecode):
            request = work.advance(self._join(request))
        if work.finished and work in self._after:
            handle = self._after.pop(work)
            if work.future.exception() is None:
                self._running.append(handle)
            else:
                self._end(handle, StepResult(error=work.future.exception()))

    def _join(self, request: JoinDecode) -> DecodeHandle:
        """The sequence's handle; it decodes from the next step (after its work before the
        first step, if any, has run)."""
        handle = DecodeHandle(request.sequence, request.reservation)
        if request.before is None:
            self._running.append(handle)
            return handle
        before = PromptWork(request.before, handle.cancellation)
        self._after[before] = handle
        self._works.append(before)
        return handle

    def _fail(self, work: PromptWork, error: BaseException) -> None:
        """End a work with ``error`` (its cleanup's own failure only logged); a sequence waiting
        for it before its first step leaves too (its place given back, the error delivered)."""
        try:
            work.fail(error)
        finally:
            handle = self._after.pop(work, None)
            if handle is not None and handle.cancelled:
                self._give_back(handle)
            elif handle is not None:
                self._end(handle, StepResult(error=error))

    def _leave(self, handle: DecodeHandle, result: StepResult) -> None:
        """A running sequence leaves the batch with its last ``result`` (:meth:`_end`)."""
        self._running.remove(handle)
        self._end(handle, result)

    def _end(self, handle: DecodeHandle, result: StepResult) -> None:
        """Give a sequence's place back, then tell its request ``result``, or the error that
        giving the place back raised when ``result`` has none. The request is told whatever
        the release did."""
        error: Exception | None = None
        try:
            error = self._give_back(handle)
        finally:
            if error is not None and result.error is None:
                result = StepResult(result.pieces, error)
            handle.deliver(result)

    def _give_back(self, handle: DecodeHandle) -> Exception | None:
        """Give a sequence's place back; the exception a release callback raised (logged,
        rate-limited), if any: it belongs to this sequence's request alone."""
        try:
            self._places.release(handle.reservation)
        except Exception as error:  # noqa: BLE001 - this request's own failure
            _warnings.warning("release-failed", "giving a request's place back failed: %s: %s", type(error).__name__, error)
            return error
        return None


def _held_length(segment: Segment) -> int | Exception:
    """The length a segment's cache holds before a pass, or the exception reading it raised
    (the segment then does not run: the exception ends its owner alone)."""
    try:
        return segment.cache.get_seq_length()
    except Exception as exc:  # noqa: BLE001 - handed to the segment's owner
        return exc


def _restore_length(segment: Segment, length: int) -> None:
    """Give a segment's cache back the length it had before a failed pass."""
    if segment.cache.get_seq_length() > length:
        truncate_cache(segment.cache, length)
