"""The request lifecycle: from a prompt's tokens to its result, beside the decode scheduler.

:class:`Requests` runs ``generate``/``stream``/``generate_batch``: plan, prefill (lookup,
stitch, repair), the first token, hand-over to the decode worker
(:class:`~kvboost_rag.decode.scheduler.DecodeScheduler`), the result, and the write-back of what the
prompt taught. Nothing here calls back into the engine facade.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch

from kvboost_rag.cancellation import Cancellation, ambient
from kvboost_rag.decode.constrained import ConstraintCompiler, GrammarGuide
from kvboost_rag.decode.drafting import drafter_for
from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler, make_generator
from kvboost_rag.decode.scheduler import DecodeHandle, DecodeScheduler, Reservation
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.errors import InvalidInputError, KVBoostError, RequestCancelled, UnsupportedModelError
from kvboost_rag.generation.missed_documents import (
    explain_evicted_documents,
    explain_missed_documents,
)
from kvboost_rag.generation.parts import EngineParts
from kvboost_rag.generation.host_buffers import HostBufferPool
from kvboost_rag.generation.slots import Lease, SlotLease
from kvboost_rag.hf.captured import SlotPool
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

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop the request early (the result stays ``None``); its place and buffers go back.

        Safe from any thread. While another thread is inside ``next()``, that call ends the
        iteration as soon as the request stops: at once while it waits for a place in the
        batch or for its turn on the model, at the prefill's next chunk boundary, at the next
        decode step.
        """
        self.cancellation.cancel()
        pieces = self._pieces
        if not inspect.isgenerator(pieces):
            return
        try:
            pieces.close()
        except ValueError:  # running in another thread: it ends there, seeing the cancellation
            if inspect.getgeneratorstate(pieces) != inspect.GEN_RUNNING:
                raise


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
        reservation: Its place in the batch while it is not handed to the decode worker yet.
        handle: Its place in the decode worker's batch once handed over.
        lease: Its K/V buffers on loan: a slot of the captured steps' pool, or buffers of the
            host buffer pool (``None``: buffers of its own).
        cancellation: The call's cancellation: once set, its sequence leaves the batch.
        unwatch: Stops its cancellation from watching the handle (once it closed).
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

    def submit(self, scheduler: DecodeScheduler) -> None:
        """Hand the sequence to the decode worker (it joins the batch at the next step)."""
        submit_together([self], scheduler)

    def close(self, scheduler: DecodeScheduler) -> None:
        """Give its place back: out of the batch at the next step if it is still decoding."""
        if self.reservation is not None:
            scheduler.release(self.reservation)
            self.reservation = None
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.cancel()
        if self.unwatch is not None:
            unwatch, self.unwatch = self.unwatch, None
            unwatch()  # the cancellation (a batch's, an async bridge's) outlives the request

    def release_slot(self) -> None:
        """The request is done reading its buffers (again, or once handed to the write-back:
        nothing)."""
        if self.lease is not None:
            self.lease.release("request")

    def release_slot_later(self) -> Callable[[], None] | None:
        """What releases the request's hold on its buffers, for whoever reads them last (the
        write-back); ``None`` without a lease."""
        lease = self.lease
        return None if lease is None else partial(lease.release, "request")


def submit_together(requests: Sequence[Request], scheduler: DecodeScheduler) -> None:
    """Hand the sequences of ``requests`` not handed over yet to the decode worker; they join
    the same step."""
    pending = [request for request in requests if request.reservation is not None]
    handles = scheduler.submit_many([(request.sequence, request.reservation) for request in pending])
    for request, handle in zip(pending, handles):
        request.handle, request.reservation = handle, None
        if request.cancellation is not None:
            request.unwatch = request.cancellation.watch(handle.cancel)


class Requests:
    """Runs generation requests for one engine.

    Args:
        parts: The engine's parts.
        scheduler: The decode worker.
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
        scheduler: DecodeScheduler,
        constraints: ConstraintCompiler,
        eos_ids: frozenset[int],
        slots: SlotPool | None = None,
        host_buffers: HostBufferPool | None = None,
    ) -> None:
        self.adapter, self.cache, self.settings = parts.adapter, parts.cache, parts.settings
        self.tokenizing, self.planner, self.prefiller, self.turns = parts.tokenizing, parts.planner, parts.prefiller, parts.turns
        self.parts, self.scheduler, self.constraints, self.eos_ids = parts, scheduler, constraints, eos_ids
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
        started: list[tuple[int, Request]] = []

        def submit_all() -> None:
            # The prefilled prompts join the batch together (and before a prefill waits for
            # a place, so the places they hold can free up).
            submit_together([request for _, request in started], self.scheduler)

        tokenized: list[tuple[int, PromptTokens]] = []
        for i, prompt in enumerate(prompts):
            try:
                tokenized.append((i, self._tokenize(prompt, resolved, f"prompt {i}")))
            except KVBoostError as error:
                outputs[i] = error
        if resolved.reuse:
            self._store_common_beginning([tokens for _, tokens in tokenized])
        try:
            cancellation = ambient()
            for i, tokens in tokenized:
                try:
                    started.append(
                        (i, self._start(tokens, resolved, start, hold=True, on_wait=submit_all, cancellation=cancellation))
                    )
                except KVBoostError as error:
                    outputs[i] = error
            submit_all()
            for i, request in started:  # the decode worker runs every started prompt meanwhile
                follow = self._follow(request, end_at_last_token=True)
                try:
                    while True:
                        next(follow)
                except StopIteration as stop:
                    outputs[i] = stop.value
                except Exception as error:  # noqa: BLE001 - what ended this prompt's decoding ends it alone
                    outputs[i] = error
        finally:
            for _, request in started:
                request.close(self.scheduler)
                request.release_slot()
        return cast("list[GenerationResult | Exception]", outputs)  # every entry is set above

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
        with self.turns.prompt_work():
            outcome = self.prefiller.run(plan)
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
            request = self._start(tokens, options, start, guide=guide, cancellation=cancellation)
            try:
                stream.result = yield from self._follow(request, end_at_last_token=False)
            finally:
                request.close(self.scheduler)
        except RequestCancelled:
            if not cancellation.cancelled:
                raise
        finally:
            unfollow()

    def _start(
        self,
        tokens: PromptTokens,
        options: GenerationOptions,
        start: float,
        *,
        hold: bool = False,
        on_wait: Callable[[], None] | None = None,
        guide: GrammarGuide | None = None,
        cancellation: Cancellation | None = None,
    ) -> Request:
        """Plan and prefill a prompt and choose its first token, after waiting for a place in
        the batch.

        Args:
            tokens: The prompt.
            options: Its options.
            start: ``perf_counter`` at the call.
            hold: Keep the sequence until :meth:`Request.submit` (a batch joins at once);
                else it is handed to the decode worker now (unless its first token ended it).
            on_wait: Called once if the request must wait for a place.
            guide: The state of the output constraint, already compiled (else compiled here
                from ``options.constraint``, when set: every sequence has its own).
            cancellation: The call's: waiting for a place or a turn ends once it is set, the
                prefill stops at its next chunk boundary, the sequence leaves the batch.

        Raises:
            RequestCancelled: ``cancellation`` was set before the first token.
        """
        n = len(tokens)
        budget = self._output_budget(n, options)
        if guide is None and options.constraint is not None:
            guide = self.constraints.compile(options.constraint, budget)
        plan = self._plan_generation(tokens, options, budget)
        reservation = self.scheduler.reserve(self._kv_bytes(n + budget), on_wait=on_wait, cancellation=cancellation)
        lease = self._lease(n + budget + SPARE_ROWS)
        if lease is not None:
            reservation.on_release.append(partial(lease.release, "decode"))
        try:
            with self.turns.prompt_work(cancellation):
                outcome = self.prefiller.run(
                    plan, reuse=options.reuse, buffers=lease.buffers if lease else None, slot=lease.slot if lease else None
                )
            sequence, first_pieces = self._first_token(plan, outcome, budget, options, guide, lease)
        except BaseException:
            self.scheduler.release(reservation)
            if lease is not None:
                lease.release("request")
            raise
        ttft_ms = (time.perf_counter() - start) * 1000
        request = Request(
            plan, options, start, outcome, sequence, ttft_ms, first_pieces, reservation, lease=lease,
            cancellation=cancellation,
        )
        if sequence.done:
            request.close(self.scheduler)
        elif not hold:
            request.submit(self.scheduler)
        return request

    def _first_token(
        self,
        plan: PromptPlan,
        outcome: PrefillOutcome,
        budget: int,
        options: GenerationOptions,
        guide: GrammarGuide | None,
        lease: Lease | None,
    ) -> tuple[DecodeSequence, list[str]]:
        """The prefilled prompt's decode state, and the text pieces of its first token."""
        sequence = DecodeSequence(
            cache=outcome.cache,
            position=plan.num_tokens,
            budget=budget,
            options=options,
            sampling=SequenceSampling(make_generator(options.seed, self.adapter.device), guide),
            assembler=TextAssembler(self.adapter.tokenizer, options.stop),
            eos_ids=self.eos_ids,
            make_drafter=partial(drafter_for, plan),
            slot=None if lease is None else lease.slot,
        )
        first_pieces = sequence.choose(outcome.logits)
        if outcome.follow_up is not None and not sequence.done:
            sequence.before_first_step = partial(_look_ahead, outcome, sequence)
        return sequence, first_pieces

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
            request: From :meth:`_start`.
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
            request.close(self.scheduler)
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
            documents_found=len(outcome.documents),
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
                # The buffers go back when the write-back read them (it calls this whatever
                # happens); the request lets go of them now.
                on_read, request.lease = request.release_slot_later(), None
                self.cache.write_back(plan, outcome, store_documents=self._stores_documents, on_read=on_read)
                self._warn_if_documents_missed(plan, outcome)
        finally:
            request.release_slot()

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
        return self.tokenizing.prompt(prompt, what, find=True, explicit=records)

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
        if plan.documents or not plan.content_reuse or not documents or outcome.live_tokens < self.settings.chunk_size:
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


def _look_ahead(outcome: PrefillOutcome, sequence: DecodeSequence) -> None:
    """Run a prefill's follow-up repair with the sequence's first token and count what it
    recomputed (those tokens no longer count as read from cache)."""
    if outcome.follow_up is None or sequence.token is None:
        return
    outcome.recomputed_tokens += outcome.follow_up(sequence.token)
    if outcome.content_tokens:
        outcome.recompute_ratio = outcome.recomputed_tokens / outcome.content_tokens


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
