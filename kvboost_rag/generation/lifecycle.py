"""The request lifecycle: from a prompt's tokens to its result, through the engine loop.

:class:`Requests` runs ``generate`` and ``stream`` (and prepares the prompts of
``generate_batch``, :mod:`~kvboost_rag.generation.batch`). On the caller's thread: the prompt's
tokens and plan and the cache lookup. Then its prompt work goes to the engine loop
(:class:`~kvboost_rag.engine_loop.loop.EngineLoop`), which admits it when its memory fits (a
place in the batch and K/V buffers, :class:`~kvboost_rag.generation.holdings.RequestMemory`)
and runs it: stitch, repair, prefill in slices beside the running answers, the first token, and
the sequence joining the running batch. The caller reads the text pieces as the loop decodes them; its end (the result,
the write-back) is :class:`~kvboost_rag.generation.completion.Completion`'s. Nothing here calls
back into the engine facade.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

from kvboost_rag.cancellation import Cancellation, ambient
from kvboost_rag.decode.constrained import ConstraintCompiler, GrammarGuide
from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.errors import RequestCancelled, UnsupportedModelError
from kvboost_rag.generation.completion import Completion
from kvboost_rag.generation.completion import decoded as decoded_output
from kvboost_rag.generation.holdings import RequestMemory
from kvboost_rag.generation.parts import EngineParts
from kvboost_rag.generation.request_work import RequestWork
from kvboost_rag.generation.started import Pending, Request
from kvboost_rag.generation.stream import GenerationStream
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.prefill.prefiller import SPARE_ROWS
from kvboost_rag.request.inputs import check_documents, check_text
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import PromptPlan, PromptTokens

__all__ = ["GenerationStream", "Requests"]

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)


class Requests:
    """Runs generation requests for one engine.

    Args:
        parts: The engine's parts.
        memory: Places and K/V buffers for its requests.
        constraints: Compiles output constraints.
        eos_ids: End-of-sequence token ids.
    """

    def __init__(self, parts: EngineParts, memory: RequestMemory, constraints: ConstraintCompiler, eos_ids: frozenset[int]) -> None:
        self.adapter, self.cache, self.settings = parts.adapter, parts.cache, parts.settings
        self.tokenizing, self.planner, self.prefiller, self.loop = parts.tokenizing, parts.planner, parts.prefiller, parts.loop
        self.parts, self.memory, self.places = parts, memory, memory.places
        self.constraints, self.eos_ids = constraints, eos_ids
        self.completion = Completion(parts)

    def stream(self, prompt: str, options: GenerationOptions, start: float) -> GenerationStream:
        """Validate, then return the stream of one prompt (see :meth:`kvboost_rag.KVBoost.stream`)."""
        tokens = self.tokenize(prompt, options)
        guide = None
        if options.constraint is not None:
            guide = self.constraints.compile(options.constraint, self._output_budget(len(tokens), options))
        stream = GenerationStream(iter(()))
        stream._pieces = self._run(stream, tokens, options, start, guide)
        return stream

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
            request = self.submit(tokens, options, start, guide=guide, cancellation=cancellation).wait(self.places)
            try:
                stream.result = yield from self.follow(request, end_at_last_token=False)
            finally:
                request.close(self.places)
        except RequestCancelled:
            if not cancellation.cancelled:
                raise
        finally:
            unfollow()

    def submit(
        self, tokens: PromptTokens, options: GenerationOptions, start: float, *, guide: GrammarGuide | None = None,
        cancellation: Cancellation,
    ) -> Pending:
        """:meth:`prepare` one prompt and hand it to the engine loop."""
        pending = self.prepare(tokens, options, start, guide=guide, cancellation=cancellation)
        self.hand_over([pending])
        return pending

    def prepare(
        self,
        tokens: PromptTokens,
        options: GenerationOptions,
        start: float,
        *,
        guide: GrammarGuide | None = None,
        cancellation: Cancellation,
        until_stored: bool = True,
    ) -> Pending:
        """Plan a prompt, look it up, and make its prompt work (admission, prefill, first
        token, joining the batch), not yet handed to the loop.

        Args:
            tokens: The prompt.
            options: Its options.
            start: ``perf_counter`` at the call.
            guide: The state of the output constraint, already compiled (else compiled here
                from ``options.constraint``, when set: every sequence has its own).
            cancellation: The call's: its work leaves the loop's queue (or its sequence the
                batch) once it is set.
            until_stored: Its bytes stay counted in the batch's until its lent buffers are
                back (whoever read them last), not only while it runs (one call; a batch's
                prompts are followed by one thread once they all ran, so they count while
                they run).
        """
        n = len(tokens)
        budget = self._output_budget(n, options)
        if guide is None and options.constraint is not None:
            guide = self.constraints.compile(options.constraint, budget)
        plan = self._plan_generation(tokens, options, budget)
        found = self.prefiller.lookup(plan) if options.reuse else None
        admission = self.memory.admission(n + budget + SPARE_ROWS, until_stored)
        work = RequestWork(plan, options, budget, guide, self.eos_ids)
        steps = work.steps(self.prefiller, found, self.adapter, admission, self.places)
        return Pending(plan, options, start, steps, admission, cancellation)

    def hand_over(self, pending: Sequence[Pending]) -> None:
        """Hand prepared prompts' work to the engine loop together (it admits them in order)."""
        if not pending:
            return
        futures = self.loop.submit_many(
            [(p.steps, p.cancellation) for p in pending], request=True, admissions=[p.admission for p in pending]
        )
        for waiting, future in zip(pending, futures):
            waiting.future, waiting.steps = future, None

    def _output_budget(self, prompt_tokens: int, options: GenerationOptions) -> int:
        """Most tokens a prompt of ``prompt_tokens`` may generate: ``max_new_tokens``, or what
        the context window leaves."""
        return min(options.max_new_tokens, self.adapter.context_window - prompt_tokens)

    def follow(self, request: Request, *, end_at_last_token: bool) -> Iterator[str]:
        """Yield a started request's text pieces as they decode, store what its prompt
        taught, and return its :class:`GenerationResult`.

        Args:
            request: From :meth:`Pending.wait`.
            end_at_last_token: ``total_ms`` ends at the last token (a batch) rather than
                after the write-back (one call).
        """
        options, sequence = request.options, request.sequence
        try:
            yield from request.first_pieces
            if request.handle is not None:
                yield from request.handle.pieces()
            decoded = decoded_output(sequence, options)  # what decoding produced, read once it is over
        finally:
            request.close(self.places)
            self.completion.store_what_it_taught(request)
        end = sequence.finished_at if end_at_last_token and sequence.finished_at is not None else time.perf_counter()
        return self.completion.result(request, decoded, end)

    def tokenize(self, prompt: str, options: GenerationOptions, what: str = "prompt") -> PromptTokens:
        """The prompt's tokens; with reuse, the documents in it are found first (known ones and
        ``options.documents``) and their stored tokens spliced in."""
        check_text(prompt, what)
        check_documents(options.documents)
        if not options.reuse:
            return self.tokenizing.prompt(prompt, what)
        records = [self.parts.document_record(d) for d in options.documents]
        blocks_as = (self.cache.fingerprint, self.settings.chunk_size) if self.completion.stores_blocks else None
        return self.tokenizing.prompt(prompt, what, find=True, explicit=records, blocks_as=blocks_as)

    def _plan_generation(self, tokens: PromptTokens, options: GenerationOptions, budget: int) -> PromptPlan:
        """The prompt's plan, with the documents found while tokenizing (when content reuse is
        allowed for it)."""
        with stage("plan"):
            if not options.reuse:
                return self.planner.plan(tokens, find_documents=False, content_reuse=False, reserve=budget)
            content = self._content_reuse_allowed(len(tokens) + options.max_new_tokens)
            return self.planner.plan(tokens, content_reuse=content, reserve=budget)

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
