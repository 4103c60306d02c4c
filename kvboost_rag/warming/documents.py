"""Warming: shared beginnings (system prompts) and documents, read once and stored.

A warm is a prefill with no decoding, through the same path as a prompt: plan, prefill,
write-back. Documents are computed behind the document context (the system prompt that
precedes documents in prompts, so their first tokens are not attention sinks) and up to
``warm_context_documents`` other documents, several per forward pass when the model allows
(:mod:`kvboost_rag.warming.batch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvboost_rag.cancellation import ambient
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.generation.parts import EngineParts
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.documents import (
    ANCHOR_CHARS,
    DocumentOccurrence,
    DocumentRecord,
)
from kvboost_rag.request.inputs import check_text
from kvboost_rag.request.plan import PromptTokens
from kvboost_rag.results import WarmResult
from kvboost_rag.warming.batch import WarmJob, batches
from kvboost_rag.warming.fit import corpus_fit, kept_summary, summary_line

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: Text documents are warmed behind when no ``warm_prefix`` is set, so a document's first
#: tokens are not computed at position 0 (where they would act as attention sinks).
DEFAULT_DOCUMENT_LEAD_IN = "Reference documents:\n\n"
#: Follows each context document a document is warmed behind (see ``warm_context_documents``).
CONTEXT_DOCUMENT_SEPARATOR = "\n\n"
_NO_TOKENS = PromptTokens("", [], [])


@dataclass
class DocumentWarm:
    """One document of a ``warm_documents`` call, from its plan to its ``WarmResult``."""

    record: DocumentRecord
    cached_tokens: int
    already_warm: bool
    started: float
    job: WarmJob | None = None
    repeat_of: DocumentWarm | None = None
    new_tokens: int = 0
    elapsed_ms: float | None = None

    def finish(self, new_tokens: int, elapsed_ms: float) -> None:
        """Record what computing it stored and its share of the batch's time."""
        self.new_tokens = new_tokens
        self.elapsed_ms = elapsed_ms

    def result(self) -> WarmResult:
        """Its result (a repeat of a document warmed in the same call reports it as warm)."""
        n = len(self.record.token_ids)
        if self.repeat_of is not None:
            first = self.repeat_of
            return first.result().model_copy(
                update={"new_tokens": 0, "cached_tokens": first.new_tokens + first.cached_tokens, "already_warm": True}
            )
        return WarmResult(
            kind="document",
            num_tokens=n,
            new_tokens=self.new_tokens,
            cached_tokens=self.cached_tokens,
            skipped_tokens=n - self.new_tokens - self.cached_tokens,
            already_warm=self.already_warm,
            elapsed_ms=self.elapsed_ms if self.elapsed_ms is not None else (time.perf_counter() - self.started) * 1000,
            content_hash=self.record.chunk_keys[0] if self.record.chunk_keys else None,
        )


class Warming:
    """Warms beginnings and documents for one engine.

    Args:
        parts: The engine's parts (a warm is a prefill through them, with no decoding).
    """

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.adapter, self.cache, self.settings = parts.adapter, parts.cache, parts.settings
        self.tokenizing, self.planner, self.prefiller, self.loop = parts.tokenizing, parts.planner, parts.prefiller, parts.loop
        self._last_beginning: str | None = None
        # The first distinct documents warmed: others are warmed behind them.
        self._context_documents: list[str] = []

    # ------------------------------------------------------------------ beginnings
    def warm(self, text: str) -> WarmResult:
        """Warm ``text`` as a shared beginning, pinned (see :meth:`kvboost_rag.KVBoost.warm`)."""
        result = self.warm_beginning(text)
        self._last_beginning = text
        self.cache.flush()  # stored and pinned in the tiers when the call returns
        return result

    @property
    def document_context(self) -> str:
        """The text documents are warmed behind: ``settings.warm_prefix``, else the most
        recent text passed to :meth:`warm`, else a short neutral lead-in."""
        if self.settings.warm_prefix is not None:
            return self.settings.warm_prefix
        if self._last_beginning is not None:
            return self._last_beginning
        return DEFAULT_DOCUMENT_LEAD_IN

    def warm_beginning(self, text: str) -> WarmResult:
        """Compute (unless stored) and pin ``text`` as exact prefix chunks."""
        start = time.perf_counter()
        tokens = self.tokenizing.prompt(text, "warmed text")
        n = len(tokens)
        plan = self.planner.plan(tokens, find_documents=False, content_reuse=False, lookup_limit=n)
        outcome = self.loop.run(self.prefiller.steps(plan, self.prefiller.lookup(plan)), ambient())
        self.cache.write_back(plan, outcome, store_documents=False, pin=True)
        return WarmResult(
            kind="prefix",
            num_tokens=n,
            new_tokens=n - outcome.prefix_tokens,
            cached_tokens=outcome.prefix_tokens,
            already_warm=outcome.prefix_tokens == n,
            elapsed_ms=(time.perf_counter() - start) * 1000,
            prefix_hash=plan.stored_prefix[-1].key,
        )

    # ------------------------------------------------------------------ documents
    def document_record(self, text: str, register: bool = True) -> DocumentRecord:
        """See :meth:`~kvboost_rag.generation.parts.EngineParts.document_record`."""
        return self.parts.document_record(text, register)

    def is_document_warm(self, text: str) -> bool:
        """Whether every chunk of ``text`` is cached and its record is stored (reads only)."""
        if not isinstance(text, str) or not text:
            return False
        record = self.cache.index.find_document(text)
        return record is not None and not self.cache.missing_chunks(record)

    def warm_documents(self, texts: Iterable[str], show_progress: bool | None = None) -> list[WarmResult]:
        """Warm documents (see :meth:`kvboost_rag.KVBoost.warm_documents`)."""
        texts = _checked_documents(texts)
        progress = self.settings.show_progress if show_progress is None else show_progress
        records = [self.document_record(text, register=False) for text in texts]
        self._warn_if_corpus_does_not_fit(records)
        self._remember_context_documents(records)
        contexts = [self._context_for(record) for record in records]
        warms = self._plan_warms(records, contexts)
        bar = tqdm(total=len(texts), desc="warming documents", unit="doc", disable=not progress or len(texts) < 2)
        per_token = self.cache.bytes_per_token()
        computed_bytes = 0
        with bar:
            bar.update(sum(1 for warm in warms if warm.job is None))
            for group in self._groups(warms, contexts):
                start = time.perf_counter()
                stored = self._warm_batch(group)
                share = (time.perf_counter() - start) * 1000 / len(group)
                for job in group:
                    warms[job.index].finish(stored[job.index], share)
                computed_bytes += int(sum(stored.values()) * per_token)
                memory_mib = self.cache.memory_used_bytes / 1024**2
                bar.set_postfix_str(f"{computed_bytes / 1024**2:.0f} MiB K/V, memory {memory_mib:.0f} MiB", refresh=False)
                bar.update(len(group))
        self.cache.flush()  # where each document is kept, once its writes are done
        kept_in = {record.digest: self.cache.index.kept_in(record) for record in records}
        results = [warm.result().model_copy(update={"kept_in": kept_in[warm.record.digest]}) for warm in warms]
        kept, by_tier = kept_summary(list(kept_in.values()))
        line = summary_line(len(kept_in), kept, by_tier, computed_bytes)
        if kept < len(kept_in):
            _warnings.warning("documents-lost-in-warm", "%s", line)
        else:
            logger.info("%s", line)
        return results

    def _plan_warms(self, records: list[DocumentRecord], contexts: list[tuple[str, ...]]) -> list[DocumentWarm]:
        """What each document needs; a lead-in is warmed only when a document behind it needs
        computing (warming stored documents reads their records, no K/V)."""
        leads: dict[tuple[str, ...], PromptTokens] = {}
        warms = []
        for record, context in zip(records, contexts):
            lead = None
            if self.cache.missing_chunks(record):
                lead = leads.get(context)
                if lead is None:
                    lead = leads[context] = self._lead_in(context)
            warm = self._plan_document_warm(record, lead)
            if warm.job is None:
                self.cache.index.register(record)  # nothing to compute: stored already, or prefix-only
            warms.append(warm)
        first: dict[str, int] = {}
        for i, warm in enumerate(warms):
            if warm.job is None:
                continue
            earlier = first.setdefault(warm.record.digest, i)
            # A repeat of a text computed in this call is warm once the first copy is stored.
            warm.job = WarmJob(index=i, plan=warm.job.plan) if earlier == i else None
            warm.repeat_of = None if earlier == i else warms[earlier]
        return warms

    def _groups(self, warms: list[DocumentWarm], contexts: list[tuple[str, ...]]) -> list[list[WarmJob]]:
        """The jobs in forward-pass groups: a group shares one lead-in."""
        behind: dict[tuple[str, ...], list[WarmJob]] = {}
        for warm, context in zip(warms, contexts):
            if warm.job is not None:
                behind.setdefault(context, []).append(warm.job)
        return [group for jobs in behind.values() for group in batches(jobs, self.settings.warm_batch_tokens)]

    def _warn_if_corpus_does_not_fit(self, records: Sequence[DocumentRecord]) -> None:
        """Warn (once a minute at most) when the documents' K/V exceed what the tiers keep."""
        tokens = {record.digest: len(record.token_ids) for record in records}
        fit = corpus_fit(tokens, self.cache.bytes_per_token(), self.cache.tier_budgets())
        if fit is not None and not fit.fits:
            _warnings.warning("corpus-too-large", "%s", fit.warning())
        elif fit is not None and not fit.fits_memory:
            logger.info("%s", fit.overflow_line())

    def _warm_batch(self, group: list[WarmJob]) -> dict[int, int]:
        """Compute and store a group of documents: their prefills go to the engine loop
        together (it packs them into shared passes, beside the running answers), then each is
        stored as a one-by-one warm stores it.

        Raises:
            Exception: What ended a document's prefill (after the others were stored).
        """
        works = [self.prefiller.steps(job.plan, self.prefiller.lookup(job.plan)) for job in group]
        outcomes = self.loop.run_all(works, ambient())  # a cancelled caller (an async bridge's) ends them
        stored: dict[int, int] = {}
        for job, outcome in zip(group, outcomes):
            if not isinstance(outcome, BaseException):
                stored[job.index] = self.cache.write_back(job.plan, outcome, store_documents=True)
        failed = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failed is not None:
            raise failed
        return stored

    def _remember_context_documents(self, records: list[DocumentRecord]) -> None:
        """Keep the first distinct documents warmed (one more than ``warm_context_documents``,
        so that each of them has others to be warmed behind), skipping documents too long to
        leave room in the context window."""
        wanted = self.settings.warm_context_documents
        if not wanted:
            return
        longest = self.adapter.context_window // (4 * wanted)
        for record in records:
            if len(self._context_documents) > wanted:
                return
            if record.text not in self._context_documents and len(record.token_ids) <= longest:
                self._context_documents.append(record.text)

    def _context_for(self, record: DocumentRecord) -> tuple[str, ...]:
        """The documents ``record`` is warmed behind: the first context documents but itself."""
        others = (text for text in self._context_documents if text != record.text)
        return tuple(others)[: self.settings.warm_context_documents]

    def _lead_in(self, context: tuple[str, ...]) -> PromptTokens:
        """The document context followed by the ``context`` documents, warmed (pinned) as a
        beginning; empty when it is all blank."""
        lead_in = self.document_context + "".join(text + CONTEXT_DOCUMENT_SEPARATOR for text in context)
        if not lead_in.strip():
            return _NO_TOKENS
        self.warm_beginning(lead_in)
        return self.tokenizing.prompt(lead_in, "document context")

    def _plan_document_warm(self, record: DocumentRecord, lead: PromptTokens | None) -> DocumentWarm:
        """What warming ``record`` behind ``lead`` takes: nothing when its chunks are stored,
        else a plan of the lead-in then the document's own tokens (``lead`` is ``None`` only
        when no document of the call needs computing)."""
        start = time.perf_counter()
        lead = lead if lead is not None else _NO_TOKENS
        n = len(record.token_ids)
        usable = max(0, min(n, self.adapter.context_window - len(lead) - 1))
        if usable < n:
            _warnings.warning(
                "long-document",
                "a document of %d tokens does not fit the context window after the document context; "
                "warming its first %d tokens",
                n,
                usable,
            )
        whole = record.whole_chunks(usable)
        missing = set(self.cache.missing_chunks(record, whole))
        cached_tokens = sum(record.chunk_length(c) for c in whole if c not in missing)
        warm = DocumentWarm(record=record, cached_tokens=cached_tokens, already_warm=not missing, started=start)
        if missing and self.adapter.position_independent:
            end = whole[-1] * record.chunk_size + record.chunk_length(whole[-1])
            part = record.text[: record.offsets[end - 1][1]]
            shift = len(lead.text)
            tokens = PromptTokens(
                lead.text + part,
                lead.ids + list(record.token_ids[:end]),
                lead.offsets + [(x + shift, y + shift) for x, y in record.offsets[:end]],
            )
            placed = DocumentOccurrence(record, shift, len(part))
            plan = self.planner.plan(tokens, placed=[placed], content_reuse=False, lookup_limit=len(lead))
            warm.job = WarmJob(index=-1, plan=plan)
        else:
            warm.elapsed_ms = (time.perf_counter() - start) * 1000
        return warm


def _checked_documents(texts: Iterable[str]) -> list[str]:
    """The documents as a list, each checked; warns about documents too short to be found."""
    if isinstance(texts, (str, bytes)):
        raise InvalidInputError("warm_documents takes a list of documents, not one string: pass [text]")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"document {i} is empty; every document needs text")
        check_text(text, f"document {i}")
    short = sum(1 for text in texts if len(text) < ANCHOR_CHARS)
    if short:
        logger.warning(
            "%d document(s) shorter than %d characters are cached but found in prompts only "
            "when passed to generate(documents=...)",
            short,
            ANCHOR_CHARS,
        )
    return texts
