"""The request lifecycle: from a prompt's tokens to its result, through the engine loop.

:class:`Requests` runs ``generate``/``stream``/``generate_batch``. On the caller's thread: the
prompt's tokens and plan, its place in the batch
(:class:`~kvboost_rag.engine_loop.places.BatchPlaces`), its buffers, the cache lookup. Then its
prompt work goes to the engine loop (:class:`~kvboost_rag.engine_loop.loop.EngineLoop`):
stitch, repair, prefill in slices beside the running answers, the first token, and the
sequence joining the running batch. The caller reads the text pieces as the loop decodes them,
builds the result and hands what the prompt taught to the write-back. Nothing here calls back
into the engine facade.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch

from kvboost_rag.cancellation import Cancellation, ambient
from kvboost_rag.decode.constrained import ConstraintCompiler, GrammarGuide
from kvboost_rag.decode.handle import DecodeHandle
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.engine_loop import BatchPlaces, Reservation
from kvboost_rag.errors import InvalidInputError, KVBoostError, RequestCancelled, UnsupportedModelError
from kvboost_rag.generation.missed_documents import (
    escaped_documents,
    explain_evicted_documents,
    explain_missed_documents,
)
from kvboost_rag.generation.parts import EngineParts
from kvboost_rag.generation.host_buffers import HostBufferPool
from kvboost_rag.generation.request_work import RequestWork, Started
from kvboost_rag.generation.slots import Lease, SlotLease
from kvboost_rag.hf.captured import SlotPool
from kvboost_rag.hf.passes import PassSteps
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.prefill.outcome import PrefillOutcome
from kvboost_rag.prefill.prefiller import SPARE_ROWS
from kvboost_rag.request.inputs import check_documents, check_text
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import PromptPlan, PromptTokens
from kvboost_rag.results import GenerationResult

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)


class GenerationStream:
    """Iterator over generated text pieces; ``result`` is set once it is exhausted.

    Attributes:
        cancellation: The request's cancellation (:meth:`close` sets it).
    """

    def __init__(self, pieces: Iterator[str], cancellation: Cancellation | None = None) -> None:
        self._pieces = pieces
        self.cancellation = cancellation or Cancellation()
        self.result: GenerationResult | None = None
        self._iterating = threading.Lock()  # held by the thread inside next()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        with self._iterating:
            return next(self._pieces)

    def close(self) -> None:
        """Stop the request early (the result stays ``None``); its place and buffers go back.

        Safe from any thread. While another thread is inside ``next()``, that call ends the
        iteration as soon as the request stops (the generator is never touched from two
        threads at once): at once while it waits for a place in the batch or while its prompt
        work waits in the engine loop's queue, at the loop's next step while it prefills or
        decodes. Otherwise the stream's generator is closed here.
        """
        self.cancellation.cancel()
        pieces = self._pieces
        if not inspect.isgenerator(pieces) or not self._iterating.acquire(blocking=False):
            return  # another thread is inside next(): it ends there, seeing the cancellation
        try:
            pieces.close()
        finally:
            self._iterating.release()


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
        write-back, whose queue counts them from now on); ``None`` without a lease."""
        self._stop_counting()
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
        reservation: Its place in the batch.
        lease: Its K/V buffers on loan.
        cancellation: The call's cancellation.
        future: The prompt work's future (a :class:`Started`), once handed to the loop.
    """

    plan: PromptPlan
    options: GenerationOptions
    start: float
    steps: PassSteps[Started] | None
    reservation: Reservation
    lease: Lease | None
    cancellation: Cancellation
    future: Future | None = None

    def wait(self, places: BatchPlaces) -> Request:
        """The request once its first token is chosen (its place and buffers go back when it
        failed or was cancelled first).

        Raises:
            RequestCancelled: The call was cancelled before its first token.
            Exception: What ended its prompt work.
        """
        assert self.future is not None, "wait for a request handed to the engine loop"
        try:
            started: Started = _settled(self.future, self.cancellation)
        except BaseException:
            places.release(self.reservation)
            places.release_bytes(self.reservation)
            if self.lease is not None:
                self.lease.release("request")
            raise
        joined = started.handle is not None
        request = Request(
            self.plan, self.options, self.start, started.outcome, started.sequence,
            (started.first_token_at - self.start) * 1000, started.first_pieces,
            None if joined else self.reservation, started.handle, self.lease, self.cancellation,
            counted=partial(places.release_bytes, self.reservation),
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


class Requests:
    """Runs generation requests for one engine.

    Args:
        parts: The engine's parts.
        places: The batch's places.
        constraints: Compiles output constraints.
        eos_ids: End-of-sequence token ids.
        slots: The captured steps' pool, when the engine decodes through captured steps: each
            request prefills into a slot of it and decodes there (one that finds no free slot
            decodes on the eager path).
        host_buffers: Reused K/V buffers (a model on the CPU): each request without a slot
            prefills into buffers lent by it.
    """

    def __init__(
        self,
        parts: EngineParts,
        places: BatchPlaces,
        constraints: ConstraintCompiler,
        eos_ids: frozenset[int],
        slots: SlotPool | None = None,
        host_buffers: HostBufferPool | None = None,
    ) -> None:
        self.adapter, self.cache, self.settings = parts.adapter, parts.cache, parts.settings
        self.tokenizing, self.planner, self.prefiller, self.loop = parts.tokenizing, parts.planner, parts.prefiller, parts.loop
        self.parts, self.places, self.constraints, self.eos_ids = parts, places, constraints, eos_ids
        self.slots, self.host_buffers = slots, host_buffers

    def stream(self, prompt: str, options: GenerationOptions, start: float) -> GenerationStream:
        """Validate, then return the stream of one prompt (see :meth:`kvboost_rag.KVBoost.stream`)."""
        tokens = self._tokenize(prompt, options)
        guide = None
        if options.constraint is not None:
            guide = self.constraints.compile(options.constraint, self._output_budget(len(tokens), options))
        stream = GenerationStream(iter(()))
        stream._pieces = self._run(stream, tokens, options, start, guide)
        return stream

    def generate_batch(
        self, prompts: Sequence[str], resolved: GenerationOptions, start: float
    ) -> list[GenerationResult | Exception]:
        """Prefill each prompt, decode them together (see :meth:`kvboost_rag.KVBoost.generate_batch`)."""
        if isinstance(prompts, (str, bytes)):
            raise InvalidInputError("generate_batch takes a list of prompts, not one string: pass [prompt]")
        prompts = list(prompts)
        check_documents(resolved.documents)
        if resolved.constraint is not None:
            # Shared by every prompt: a bad one, or too small a budget for it, fails the call.
            self.constraints.compile(resolved.constraint, resolved.max_new_tokens)
        outputs: list[GenerationResult | Exception | None] = [None] * len(prompts)
        tokenized: list[tuple[int, PromptTokens]] = []
        for i, prompt in enumerate(prompts):
            try:
                tokenized.append((i, self._tokenize(prompt, resolved, f"prompt {i}")))
            except KVBoostError as error:
                outputs[i] = error
        if resolved.reuse:
            self._store_common_beginning([tokens for _, tokens in tokenized])
        cancellation = Cancellation()
        unfollow = cancellation.follow(ambient())
        pending: list[tuple[int, Pending]] = []
        firsts: dict[int, Request] = {}  # reached their first token while a later prompt waited
        started: list[Request] = []
        waited = 0

        def first_tokens() -> None:
            """A later prompt waits for a place: the prompts handed over reach their first
            token, and those that end there give their places back (nothing else would)."""
            for i, waiting in pending:
                if i not in firsts and outputs[i] is None:
                    try:
                        firsts[i] = waiting.wait(self.places)
                    except KVBoostError as error:
                        outputs[i] = error

        try:
            self._submit_batch(tokenized, resolved, start, cancellation, outputs, pending, first_tokens)
            for waited, (i, waiting) in enumerate(pending, start=1):
                if outputs[i] is not None:
                    continue
                try:
                    request = firsts.pop(i) if i in firsts else waiting.wait(self.places)
                except KVBoostError as error:
                    outputs[i] = error
                    continue
                started.append(request)
                outputs[i] = self._follow_to_end(request)
        finally:
            cancellation.cancel()  # what was not followed (an error above) stops
            for i, waiting in pending[waited:]:
                if i not in firsts and outputs[i] is None:
                    _drain(waiting, self.places)
            for request in [*started, *firsts.values()]:
                request.close(self.places)
                request.release_slot()
            unfollow()
        return cast("list[GenerationResult | Exception]", outputs)  # every entry is set above

    def _submit_batch(
        self,
        tokenized: Sequence[tuple[int, PromptTokens]],
        options: GenerationOptions,
        start: float,
        cancellation: Cancellation,
        outputs: list[GenerationResult | Exception | None],
        pending: list[tuple[int, Pending]],
        on_full: Callable[[], None],
    ) -> None:
        """Prepare every prompt of a batch and hand them to the loop together (their passes
        then share its steps), each appended to ``pending``; when a prompt has to wait for a
        place, those prepared so far are handed over first and ``on_full`` runs, so places
        can free up. A prompt refused alone gets its error in ``outputs``."""
        held: list[Pending] = []

        def hand_over() -> None:
            self._hand_over(held)
            held.clear()

        def make_room() -> None:
            hand_over()
            on_full()

        try:
            for i, tokens in tokenized:
                try:
                    prepared = self._prepare(
                        tokens, options, start, cancellation=cancellation, on_wait=make_room, until_stored=False
                    )
                except KVBoostError as error:
                    outputs[i] = error
                    continue
                held.append(prepared)
                pending.append((i, prepared))
        finally:
            hand_over()

    def _follow_to_end(self, request: Request) -> GenerationResult | Exception:
        """A batch prompt's result, or what ended its decoding."""
        follow = self._follow(request, end_at_last_token=True)
        try:
            while True:
                next(follow)
        except StopIteration as stop:
            return stop.value
        except Exception as error:  # noqa: BLE001 - what ended this prompt's decoding ends it alone
            return error

    def _store_common_beginning(self, prompts: Sequence[PromptTokens]) -> None:
        """Compute once, and store, the leading tokens several prompts share (at least one
        chunk), so that each of them reads it as an exact prefix hit instead of computing it;
        nothing is computed when it is stored already."""
        if len(prompts) < 2:
            return
        first = prompts[0]
        common = min(len(p) for p in prompts) - 1  # every prompt computes its last token
        for other in prompts[1:]:
            common = next((j for j in range(common) if other.ids[j] != first.ids[j]), common)
        if common < self.settings.chunk_size:
            return
        tokens = PromptTokens(first.text[: first.offsets[common - 1][1]], first.ids[:common], first.offsets[:common])
        plan = self.planner.plan(tokens, find_documents=False, content_reuse=False, lookup_limit=common)
        outcome = self.loop.run(self.prefiller.steps(plan, self.prefiller.lookup(plan)))
        if outcome.logits is not None:  # something was computed: store it
            self.cache.write_back(plan, outcome, store_documents=False)

    def _run(
        self,
        stream: GenerationStream,
        tokens: PromptTokens,
        options: GenerationOptions,
        start: float,
        guide: GrammarGuide | None = None,
    ) -> Iterator[str]:
        """text -> plan -> lookup/stitch/repair -> decode (batched) -> write-back, in that order;
        a cancelled stream ends early (its result stays ``None``)."""
        cancellation = stream.cancellation
        unfollow = cancellation.follow(ambient())  # iterated under an async bridge's cancellation
        try:
            request = self._submit(tokens, options, start, guide=guide, cancellation=cancellation).wait(self.places)
            try:
                stream.result = yield from self._follow(request, end_at_last_token=False)
            finally:
                request.close(self.places)
        except RequestCancelled:
            if not cancellation.cancelled:
                raise
        finally:
            unfollow()

    def _submit(
        self, tokens: PromptTokens, options: GenerationOptions, start: float, *, guide: GrammarGuide | None = None,
        cancellation: Cancellation,
    ) -> Pending:
        """:meth:`_prepare` one prompt and hand it to the engine loop."""
        pending = self._prepare(tokens, options, start, guide=guide, cancellation=cancellation)
        self._hand_over([pending])
        return pending

    def _prepare(
        self,
        tokens: PromptTokens,
        options: GenerationOptions,
        start: float,
        *,
        guide: GrammarGuide | None = None,
        cancellation: Cancellation,
        on_wait: Callable[[], None] | None = None,
        until_stored: bool = True,
    ) -> Pending:
        """Plan a prompt, wait for its place in the batch, take its buffers, look it up, and
        make its prompt work (prefill, first token, joining the batch).

        Args:
            tokens: The prompt.
            options: Its options.
            start: ``perf_counter`` at the call.
            guide: The state of the output constraint, already compiled (else compiled here
                from ``options.constraint``, when set: every sequence has its own).
            cancellation: The call's: waiting for a place ends once it is set, the loop drops
                its prompt work at the next step, its sequence leaves the batch.
            on_wait: Called once if it must wait for a place.
            until_stored: Its buffers stay counted in the batch's bytes until its write-back
                takes them, not only while it runs (one call; a batch's prompts are followed
                by one thread once they all ran, so they count while they run).

        Raises:
            RequestCancelled: ``cancellation`` was set before a place came.
        """
        n = len(tokens)
        budget = self._output_budget(n, options)
        if guide is None and options.constraint is not None:
            guide = self.constraints.compile(options.constraint, budget)
        plan = self._plan_generation(tokens, options, budget)
        capacity = n + budget + SPARE_ROWS
        reservation = self.places.reserve(self._reserved_bytes(capacity), cancellation, on_wait)
        reservation.until_stored = until_stored
        lease = self._lease(capacity)
        if lease is not None:
            reservation.on_release.append(partial(lease.release, "decode"))
        try:
            found = self.prefiller.lookup(plan) if options.reuse else None
            work = RequestWork(plan, options, budget, guide, reservation, self.eos_ids)
            steps = work.steps(self.prefiller, found, self.adapter, lease)
        except BaseException:
            self.places.release(reservation)
            self.places.release_bytes(reservation)
            if lease is not None:
                lease.release("request")
            raise
        return Pending(plan, options, start, steps, reservation, lease, cancellation)

    def _hand_over(self, pending: Sequence[Pending]) -> None:
        """Hand prepared prompts' work to the engine loop together."""
        if not pending:
            return
        futures = self.loop.submit_many([(p.steps, p.cancellation) for p in pending], request=True)
        for waiting, future in zip(pending, futures):
            waiting.future, waiting.steps = future, None

    def _lease(self, capacity: int) -> Lease | None:
        """K/V buffers of ``capacity`` tokens on loan: a slot of the captured steps' pool, else
        buffers of the host pool; ``None`` (buffers of its own) when neither lends any."""
        lease = None if self.slots is None else SlotLease.take(self.slots, capacity)
        if lease is None and self.host_buffers is not None:
            lease = self.host_buffers.lease(capacity)
        return lease

    def _output_budget(self, prompt_tokens: int, options: GenerationOptions) -> int:
        """Most tokens a prompt of ``prompt_tokens`` may generate: ``max_new_tokens``, or what
        the context window leaves."""
        return min(options.max_new_tokens, self.adapter.context_window - prompt_tokens)

    def _follow(self, request: Request, *, end_at_last_token: bool) -> Iterator[str]:
        """Yield a started request's text pieces as they decode, store what its prompt
        taught, and return its :class:`GenerationResult`.

        Args:
            request: From :meth:`Pending.wait`.
            end_at_last_token: ``total_ms`` ends at the last token (a batch) rather than
                after the write-back (one call).
        """
        plan, outcome, options, sequence = request.plan, request.outcome, request.options, request.sequence
        try:
            yield from request.first_pieces
            if request.handle is not None:
                yield from request.handle.pieces()
            decoded = _decoded(sequence, options)  # what decoding produced, read once it is over
        finally:
            request.close(self.places)
            self._store_what_it_taught(request)
        end = sequence.finished_at if end_at_last_token and sequence.finished_at is not None else time.perf_counter()
        token_ids, text, finish_reason, step_logits = decoded
        n = plan.num_tokens
        # Only K/V that was loaded and kept counts: tokens the repair recomputed were computed here.
        cached = outcome.prefix_tokens + outcome.content_tokens - outcome.recomputed_tokens
        return GenerationResult(
            output_text=text,
            token_ids=token_ids,
            generated_tokens=len(token_ids),
            drafted_tokens=sequence.drafts.drafted_tokens,
            draft_steps=sequence.drafts.draft_steps,
            decode_steps=sequence.drafts.decode_steps,
            finish_reason=finish_reason,
            ttft_ms=request.ttft_ms,
            total_ms=(end - request.start) * 1000,
            prompt_tokens=n,
            cached_tokens=cached,
            prefix_hit_tokens=outcome.prefix_tokens,
            content_hit_tokens=outcome.content_tokens,
            recomputed_tokens=outcome.recomputed_tokens,
            recompute_ratio=outcome.recompute_ratio,
            live_tokens=outcome.live_tokens,
            boundary_merged_tokens=outcome.merged_tokens,
            documents_found=len(plan.known(outcome.documents)),
            kv_reuse_ratio=cached / n,
            strategy=outcome.strategy,
            first_token_logits=outcome.logits.detach().cpu() if options.return_logits else None,
            step_logits=step_logits,
        )

    def _store_what_it_taught(self, request: Request) -> None:
        """Off the path to the first token: counters, the write-back (staged now, stored
        behind the call), diagnosis. The request's buffers go back once the write-back read
        them (at once without reuse)."""
        plan, outcome = request.plan, request.outcome
        try:
            if request.options.reuse:
                self.cache.record(plan, outcome)
                self._warn_if_documents_missed(plan, outcome)  # before its blocks are stored
                # The buffers go back when the write-back read them (it calls this whatever
                # happens); the request lets go of them now.
                on_read, request.lease = request.release_slot_later(), None
                try:
                    self.cache.write_back(plan, outcome, store_documents=self._stores_documents, on_read=on_read)
                except Exception as error:  # noqa: BLE001 - the answer stands; its write is dropped whole
                    _warnings.warning(
                        "write-back-refused", "storing a prompt's K/V failed (%s: %s); its answer stands",
                        type(error).__name__, str(error),
                    )
        finally:
            request.release_slot()

    def _reserved_bytes(self, capacity: int) -> int:
        """Bytes the K/V buffers of ``capacity`` positions take: as the host pool rounds them
        when it lends them, else exactly."""
        if self.host_buffers is not None:
            capacity = self.host_buffers.capacity_for(capacity)
        return self._kv_bytes(capacity)

    def _kv_bytes(self, tokens: int) -> int:
        """Bytes of the K and V buffers of ``tokens`` positions."""
        return self.adapter.kv_bytes_per_token * tokens

    def _tokenize(self, prompt: str, options: GenerationOptions, what: str = "prompt") -> PromptTokens:
        """The prompt's tokens; with reuse, the documents in it are found first (known ones and
        ``options.documents``) and their stored tokens spliced in."""
        check_text(prompt, what)
        check_documents(options.documents)
        if not options.reuse:
            return self.tokenizing.prompt(prompt, what)
        records = [self.parts.document_record(d) for d in options.documents]
        blocks_as = (self.cache.fingerprint, self.settings.chunk_size) if self._stores_blocks else None
        return self.tokenizing.prompt(prompt, what, find=True, explicit=records, blocks_as=blocks_as)

    def _plan_generation(self, tokens: PromptTokens, options: GenerationOptions, budget: int) -> PromptPlan:
        """The prompt's plan, with the documents found while tokenizing (when content reuse is
        allowed for it)."""
        with stage("plan"):
            if not options.reuse:
                return self.planner.plan(tokens, find_documents=False, content_reuse=False, reserve=budget)
            content = self._content_reuse_allowed(len(tokens) + options.max_new_tokens)
            return self.planner.plan(tokens, content_reuse=content, reserve=budget)

    def _warn_if_documents_missed(self, plan: PromptPlan, outcome: PrefillOutcome) -> None:
        """Log (rate-limited) why a prompt with a long computed part held no prewarmed
        document, or held documents that were warmed and then evicted."""
        if not plan.content_reuse or outcome.live_tokens < self.settings.chunk_size:
            return
        evicted = self.cache.index.evicted_in(plan.tokens.text)
        if evicted:
            _warnings.warning(
                "documents-evicted",
                "a prompt of %d tokens (%d computed) holds %d document(s) that were warmed and then evicted "
                "from the cache: %s",
                plan.num_tokens,
                outcome.live_tokens,
                evicted,
                explain_evicted_documents(*self.cache.eviction_context()),
            )
            return
        documents = self.cache.index.document_count
        if not documents or outcome.live_tokens < self.settings.chunk_size:
            return
        known = plan.known(plan.documents)
        # A prompt whose documents are all new holds them as blocks: no warning, unless known
        # documents hide in it behind escapes (then its blocks would never hit again).
        if known or (plan.tokens.blocks and not escaped_documents(plan.tokens.text, self.cache.index.known_documents())):
            return
        _warnings.warning(
            "no-documents-found",
            "%d documents are prewarmed but none was found in a prompt of %d tokens (%d computed): %s",
            documents,
            plan.num_tokens,
            outcome.live_tokens,
            explain_missed_documents(plan.tokens.text, self.cache.index.known_documents()),
        )

    @property
    def _stores_documents(self) -> bool:
        return self.settings.store_generated_documents and self.adapter.position_independent

    @property
    def _stores_blocks(self) -> bool:
        return self.settings.store_prompt_blocks and self._stores_documents

    def _content_reuse_allowed(self, total_tokens: int) -> bool:
        if not self.adapter.position_independent:
            return False
        windows = self.adapter.windows
        if not windows.fits(total_tokens):
            message = (
                f"prompt plus new tokens ({total_tokens}) exceed the sliding window ({windows.prompt_window}); "
                "documents are not reused at new positions for this prompt"
            )
            if self.settings.strict:
                raise UnsupportedModelError(message)
            _warnings.warning("window-exceeded", message)
            return False
        return True


def _drain(waiting: Pending, places: BatchPlaces) -> None:
    """Let a request that will not be followed go (its work is cancelled): its place and
    buffers go back once the loop dropped it."""
    try:
        request = waiting.wait(places)
    except BaseException:  # noqa: BLE001 - cancelled or failed: already given back
        return
    request.close(places)
    request.release_slot()


def _decoded(sequence: DecodeSequence, options: GenerationOptions) -> tuple[list[int], str, str, torch.Tensor | None]:
    """``(token ids, text, finish reason, step logits)`` of a sequence that finished decoding
    (a constrained output cut by the budget is warned about)."""
    guide = sequence.sampling.guide
    if guide is not None and sequence.finish_reason == "length" and not guide.complete:
        _warnings.warning(
            "constraint-cut",
            "constrained output reached max_new_tokens=%d before its grammar completed; "
            "raise max_new_tokens (finish_reason='length')",
            options.max_new_tokens,
        )
    step_logits = torch.stack(sequence.step_logits) if sequence.step_logits else None
    return sequence.assembler.trimmed_token_ids(), sequence.assembler.text, sequence.finish_reason or "length", step_logits
