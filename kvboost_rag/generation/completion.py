"""A request's end: its result, and what its prompt taught handed to the write-back.

:class:`Completion` builds the :class:`~kvboost_rag.results.GenerationResult` of a request whose
decoding is over, and, off the path to the first token, records its counters, warns (rate
limited) when prewarmed documents were missed, and hands its K/V to the cache's write-back.
"""

from __future__ import annotations

import logging

import torch

from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.generation.missed_documents import (
    escaped_documents,
    explain_evicted_documents,
    explain_missed_documents,
)
from kvboost_rag.generation.parts import EngineParts
from kvboost_rag.generation.started import Request
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.prefill.outcome import PrefillOutcome
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import PromptPlan
from kvboost_rag.results import GenerationResult

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: ``(token ids, text, finish reason, step logits)`` of a finished sequence.
Decoded = tuple[list[int], str, str, "torch.Tensor | None"]


class Completion:
    """Ends the requests of one engine.

    Args:
        parts: The engine's parts (the cache and the settings are read).
    """

    def __init__(self, parts: EngineParts) -> None:
        self.adapter, self.cache, self.settings = parts.adapter, parts.cache, parts.settings

    @property
    def stores_documents(self) -> bool:
        """Whether the write-back stores documents (and prompt blocks) of prompts."""
        return self.settings.store_generated_documents and self.adapter.position_independent

    @property
    def stores_blocks(self) -> bool:
        """Whether a prompt's blocks are stored (and found) by content."""
        return self.settings.store_prompt_blocks and self.stores_documents

    def result(self, request: Request, decoded: Decoded, end: float) -> GenerationResult:
        """The result of ``request``, whose sequence produced ``decoded`` and ended at ``end``
        (``perf_counter``)."""
        plan, outcome, options, sequence = request.plan, request.outcome, request.options, request.sequence
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
            loaded_kv_bytes=outcome.loaded_kv_bytes,
            strategy=outcome.strategy,
            first_token_logits=outcome.logits.detach().cpu() if options.return_logits else None,
            step_logits=step_logits,
        )

    def store_what_it_taught(self, request: Request) -> None:
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
                    self.cache.write_back(plan, outcome, store_documents=self.stores_documents, on_read=on_read)
                except Exception as error:  # noqa: BLE001 - the answer stands; its write is dropped whole
                    _warnings.warning(
                        "write-back-refused", "storing a prompt's K/V failed (%s: %s); its answer stands",
                        type(error).__name__, str(error),
                    )
        finally:
            request.release_slot()

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


def decoded(sequence: DecodeSequence, options: GenerationOptions) -> Decoded:
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
