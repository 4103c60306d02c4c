"""The engine facade: the one entry point users and integrations call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from kvboost_rag.batch_decode import DecodeSequence, decode_step
from kvboost_rag.batch_warm import BatchWarmer, WarmJob, batchable, batches
from kvboost_rag.cache_manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.constrained import ConstraintCompiler, GrammarGuide, OutputConstraint
from kvboost_rag.corpus_fit import kept_summary, summary_line
from kvboost_rag.correctness import compare_runs
from kvboost_rag.errors import (
    InvalidInputError,
    KVBoostError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from kvboost_rag.hashing import root_hash
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.missed_documents import explain_evicted_documents, explain_missed_documents
from kvboost_rag.model_adapter import ModelAdapter
from kvboost_rag.options import GenerationOptions
from kvboost_rag.outcome import PrefillOutcome
from kvboost_rag.plan import PromptPlan, PromptTokens, build_plan
from kvboost_rag.prefill import Prefiller
from kvboost_rag.results import (
    CacheStats,
    CorrectnessReport,
    GenerationResult,
    WarmResult,
)
from kvboost_rag.sampling import SequenceSampling, TextAssembler, eos_token_ids, make_generator
from kvboost_rag.scheduler import DecodeHandle, DecodeScheduler, ModelTurns, Reservation
from kvboost_rag.segments import ANCHOR_CHARS, DocumentOccurrence, DocumentRecord, make_record
from kvboost_rag.storage import build_store

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: Text documents are warmed behind when no ``warm_prefix`` is set, so a document's first
#: tokens are not computed at position 0 (where they would act as attention sinks).
DEFAULT_DOCUMENT_LEAD_IN = "Reference documents:\n\n"
#: Follows each context document a document is warmed behind (see ``warm_context_documents``).
CONTEXT_DOCUMENT_SEPARATOR = "\n\n"


class GenerationStream:
    """Iterator over generated text pieces; ``result`` is set once it is exhausted."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop decoding early (the result stays ``None``)."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()


@dataclass
class _DocumentWarm:
    """One document of a ``warm_documents`` call, from its plan to its ``WarmResult``."""

    record: DocumentRecord
    cached_tokens: int
    already_warm: bool
    started: float
    job: WarmJob | None = None
    repeat_of: _DocumentWarm | None = None
    new_tokens: int = 0
    elapsed_ms: float | None = None

    def finish(self, new_tokens: int, elapsed_ms: float) -> None:
        """Record what computing it stored and its share of the batch's time."""
        self.new_tokens = new_tokens
        self.elapsed_ms = elapsed_ms

    def result(self) -> WarmResult:
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


@dataclass
class _Request:
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

    def submit(self, scheduler: DecodeScheduler) -> None:
        """Hand the sequence to the decode worker (it joins the batch at the next step)."""
        _submit_together([self], scheduler)

    def close(self, scheduler: DecodeScheduler) -> None:
        """Give its place back: out of the batch at the next step if it is still decoding."""
        if self.reservation is not None:
            scheduler.release(self.reservation)
            self.reservation = None
        if self.handle is not None:
            self.handle.cancel()


def _submit_together(requests: Sequence[_Request], scheduler: DecodeScheduler) -> None:
    """Hand the sequences of ``requests`` not handed over yet to the decode worker; they join
    the same step."""
    pending = [request for request in requests if request.reservation is not None]
    handles = scheduler.submit_many([(request.sequence, request.reservation) for request in pending])
    for request, handle in zip(pending, handles):
        request.handle, request.reservation = handle, None


class KVBoost:
    """Reuses the K/V of text the model has already read.

    Build it with :meth:`from_pretrained` or :meth:`from_model`. Safe to call from several
    threads: prefills and warms take turns on the model, concurrent generations decode
    together in one batch (:mod:`kvboost_rag.scheduler`), cache lookups are locked.

    Args:
        model: A transformers causal LM.
        tokenizer: Its fast tokenizer.
        settings: Engine settings.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, settings: KVBoostSettings | None = None) -> None:
        self.settings = settings or KVBoostSettings()
        if model is None:
            raise UnsupportedModelError("a model is required")
        if self.settings.device is not None:
            _check_device(self.settings.device)
            model = model.to(self.settings.device)
        self._adapter = ModelAdapter(model, tokenizer)
        if self.settings.check_layer >= self._adapter.num_layers:
            raise InvalidInputError(
                f"check_layer={self.settings.check_layer} but the model has {self._adapter.num_layers} layers"
            )
        self.model = self._adapter.model
        self.tokenizer = tokenizer
        source = str(getattr(model.config, "_name_or_path", "") or model.config.model_type)
        self.model_name = Path(source).name if Path(source).is_dir() else source
        self._last_warmed_beginning: str | None = None
        # The first distinct documents warmed: others are warmed behind them.
        self._context_documents: list[str] = []
        # The text documents are warmed behind changes their K/V only as much as any other
        # context would: it is not part of the namespace, so documents hit under any prompt.
        extra = [f"bits={self.settings.kv_cache_bits}", f"group={self.settings.kv_group_size}"]
        self.fingerprint = self._adapter.fingerprint(extra)
        self._cache = CacheManager(
            store=build_store(self.settings, self._adapter.device),
            fingerprint=self.fingerprint,
            layout=self._adapter.layout,
            settings=self.settings,
            device=self._adapter.device,
            dtype=self._adapter.dtype,
        )
        self._root = root_hash(self.fingerprint)
        self._prefiller = Prefiller(self._adapter, self._cache, self.settings)
        self._batch_warmer = BatchWarmer(self._adapter, self._cache)
        self._turns = ModelTurns()
        self._scheduler = DecodeScheduler(partial(decode_step, self._adapter), self._turns, self.settings)
        self._eos_ids = eos_token_ids(self.model, tokenizer)
        self._constraints = ConstraintCompiler(tokenizer, self._logits_width(), self._eos_ids)
        self._renders_tools: bool | None = None
        if not self._adapter.position_independent:
            if self.settings.strict:
                raise UnsupportedModelError(
                    f"position-independent reuse is not possible: {self._adapter.position_independent_reason} "
                    "(strict=False falls back to prefix-only reuse)"
                )
            logger.warning(
                "prefix-only reuse for this model: %s; documents are reused only inside an exact prefix",
                self._adapter.position_independent_reason,
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_name_or_path: str | Path | None = None, **settings: Any) -> KVBoost:
        """Load a local HuggingFace causal LM (or the embedded default) and wrap it.

        Args:
            model_name_or_path: A local model folder, a model id already in the local
                HuggingFace cache, or ``None`` for the embedded SmolLM2-135M-Instruct.
            **settings: Fields of :class:`~kvboost_rag.config.KVBoostSettings`.

        Raises:
            ModelNotFoundError: Nothing loadable at that path.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kvboost_rag.default_model import default_model_dir

        config = KVBoostSettings(**settings)
        path = default_model_dir() if model_name_or_path is None else model_name_or_path
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_device(device)
        dtype = getattr(torch, config.dtype) if config.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        local_only = not Path(path).is_dir()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=local_only)
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(f"cannot load a causal LM from {str(path)!r}: {exc}") from exc
        config.device = device
        return cls(model, tokenizer, config)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any, **settings: Any) -> KVBoost:
        """Wrap an already loaded model and tokenizer.

        Args:
            model: A transformers causal LM.
            tokenizer: Its fast tokenizer.
            **settings: Fields of :class:`~kvboost_rag.config.KVBoostSettings`.
        """
        return cls(model, tokenizer, KVBoostSettings(**settings))

    # ------------------------------------------------------------------ tokenizer helpers
    @property
    def context_window(self) -> int:
        """Largest number of positions the model accepts."""
        return self._adapter.context_window

    def token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_ids_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character spans of ``text`` tokenized alone (no special tokens)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def count_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` (no special tokens)."""
        return len(self.token_ids(text))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render chat messages with the model's chat template.

        Args:
            messages: ``{"role", "content"}`` dicts (assistant tool calls and tool results in
                the OpenAI layout the templates read).
            add_generation_prompt: Append the opening of the assistant's turn.
            tools: OpenAI-style tool definitions, passed to the template as ``tools=`` (only
                templates for which :attr:`chat_template_renders_tools` is true show them).

        Raises:
            UnsupportedModelError: The tokenizer has no chat template.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise UnsupportedModelError("this tokenizer has no chat template; pass a plain prompt instead")
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    @property
    def chat_template_renders_tools(self) -> bool:
        """Whether the chat template shows tools passed as ``tools=`` (checked once, by
        rendering one message with and without a probe tool)."""
        if self._renders_tools is None:
            if not getattr(self.tokenizer, "chat_template", None):
                self._renders_tools = False
            else:
                probe = [{"role": "user", "content": "?"}]
                tool = {
                    "type": "function",
                    "function": {
                        "name": "probe_tool_rendering",
                        "description": "probe",
                        "parameters": {"type": "object", "properties": {}},
                    },
                }
                try:
                    with_tool = self.apply_chat_template(probe, tools=[tool])
                except Exception:  # noqa: BLE001 - a template that fails on tools= does not render them
                    logger.debug("the chat template fails when given tools=", exc_info=True)
                    self._renders_tools = False
                else:
                    self._renders_tools = "probe_tool_rendering" in with_tool
        return self._renders_tools

    def _prompt_tokens(self, text: str, what: str = "prompt") -> PromptTokens:
        """Tokenize a prompt exactly as full prefill sees it (special tokens included)."""
        _check_text(text, what)
        enc = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if not ids:
            raise InvalidInputError(f"{what} has no tokens")
        if len(ids) >= self.context_window:
            raise PromptTooLongError(
                f"{what} has {len(ids)} tokens but the model's context window is {self.context_window}: "
                "retrieve fewer or shorter documents"
            )
        return PromptTokens(text, ids, [tuple(o) for o in enc["offset_mapping"]])

    def _plan(self, tokens: PromptTokens, **options: Any) -> PromptPlan:
        options.setdefault("registry", self._cache.registry)
        return build_plan(tokens, root=self._root, chunk_size=self.settings.chunk_size, **options)

    def _document_record(self, text: str, register: bool = True) -> DocumentRecord:
        """The stored record of ``text`` (read from the tiers, not re-tokenized), else a new
        one, tokenized, and (with ``register``) stored and registered; a warm registers it
        once its chunks are stored, as the newest entry of its document."""
        record = self._cache.registry.lookup(text)
        if record is None:
            ids, offsets = self.token_ids_with_offsets(text)
            record = make_record(text, ids, offsets, self.fingerprint, self.settings.chunk_size)
            if register:
                self._cache.register(record)
        return record

    # ------------------------------------------------------------------ warming
    def warm(self, text: str) -> WarmResult:
        """Cache ``text`` as a shared beginning (system prompt); prompts starting with it hit exactly.

        Warmed beginnings are pinned: eviction leaves them alone while room allows. Warming a
        text already stored computes and writes nothing (it loads and pins). Unless
        ``warm_prefix`` is set, documents warmed afterwards are computed behind the most
        recently warmed text.
        """
        result = self._warm_beginning(text)
        self._last_warmed_beginning = text
        return result

    @property
    def document_context(self) -> str:
        """The text documents are warmed behind: ``settings.warm_prefix``, else the most
        recent text passed to :meth:`warm`, else a short neutral lead-in."""
        if self.settings.warm_prefix is not None:
            return self.settings.warm_prefix
        if self._last_warmed_beginning is not None:
            return self._last_warmed_beginning
        return DEFAULT_DOCUMENT_LEAD_IN

    def _warm_beginning(self, text: str) -> WarmResult:
        start = time.perf_counter()
        tokens = self._prompt_tokens(text, "warmed text")
        n = len(tokens)
        plan = self._plan(tokens, content_reuse=False, lookup_limit=n)
        with self._turns.prompt_work():
            outcome = self._prefiller.run(plan)
        self._cache.write_back(plan, outcome, store_documents=False, pin=True)
        return WarmResult(
            kind="prefix",
            num_tokens=n,
            new_tokens=n - outcome.prefix_tokens,
            cached_tokens=outcome.prefix_tokens,
            already_warm=outcome.prefix_tokens == n,
            elapsed_ms=(time.perf_counter() - start) * 1000,
            prefix_hash=plan.stored_prefix[-1].key,
        )

    def warm_documents(self, texts: Iterable[str], show_progress: bool | None = None) -> list[WarmResult]:
        """Cache documents so they hit by content hash wherever they land in a prompt.

        Each document is computed behind :attr:`document_context` (so its first tokens are not
        attention sinks; ideally the system prompt that precedes documents in your prompts)
        followed by ``warm_context_documents`` other documents (the first ones this engine
        warmed; in a RAG prompt other retrieved documents come before it too), and stored in
        ``chunk_size`` pieces, beside a record of its text and tokens that lets any process
        over the same disk folder or Redis find it in prompts. Documents already
        cached (by this process or another) are registered without computing anything, and
        without reading their K/V. A document longer than the context window is warmed up to it
        (``WarmResult.skipped_tokens`` counts the rest).

        Args:
            texts: Document texts, exactly as they will appear in prompts.
            show_progress: Progress bar (default: ``settings.show_progress``, and only for
                more than one document).

        Raises:
            InvalidInputError: ``texts`` is one string, or a document is empty or not text.
        """
        if isinstance(texts, (str, bytes)):
            raise InvalidInputError("warm_documents takes a list of documents, not one string: pass [text]")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise InvalidInputError(f"document {i} is empty; every document needs text")
            _check_text(text, f"document {i}")
        short = sum(1 for text in texts if len(text) < ANCHOR_CHARS)
        if short:
            logger.warning(
                "%d document(s) shorter than %d characters are cached but found in prompts only "
                "when passed to generate(documents=...)",
                short,
                ANCHOR_CHARS,
            )
        progress = self.settings.show_progress if show_progress is None else show_progress
        records = [self._document_record(text, register=False) for text in texts]
        self._warn_if_corpus_does_not_fit(records)
        self._remember_context_documents(records)
        # A lead-in is warmed only when a document behind it needs computing: warming stored
        # documents reads their records, no K/V.
        leads: dict[tuple[str, ...], PromptTokens] = {}
        contexts = [self._context_for(record) for record in records]
        warms = []
        for record, context in zip(records, contexts):
            lead = None
            if self._cache.missing_chunks(record):
                lead = leads.get(context)
                if lead is None:
                    lead = leads[context] = self._lead_in(context)
            warm = self._plan_document_warm(record, lead)
            if warm.job is None:
                self._cache.register(record)  # nothing to compute: stored already, or prefix-only
            warms.append(warm)
        first: dict[str, int] = {}
        for i, warm in enumerate(warms):
            if warm.job is None:
                continue
            earlier = first.setdefault(warm.record.digest, i)
            # A repeat of a text computed in this call is warm once the first copy is stored.
            warm.job = WarmJob(index=i, plan=warm.job.plan) if earlier == i else None
            warm.repeat_of = None if earlier == i else warms[earlier]
        bar = tqdm(total=len(texts), desc="warming documents", unit="doc", disable=not progress or len(texts) < 2)
        per_token = self._cache.bytes_per_token()
        computed_bytes = 0
        with bar:
            bar.update(sum(1 for warm in warms if warm.job is None))
            behind: dict[tuple[str, ...], list[WarmJob]] = {}
            for warm, context in zip(warms, contexts):
                if warm.job is not None:
                    behind.setdefault(context, []).append(warm.job)
            budget = self.settings.warm_batch_tokens
            batched = budget and batchable(self._adapter)
            # A batch shares one lead-in: jobs are batched within each context.
            groups = [group for jobs in behind.values() for group in (batches(jobs, budget) if batched else [[job] for job in jobs])]
            for group in groups:
                start = time.perf_counter()
                stored = self._warm_batch(group)
                share = (time.perf_counter() - start) * 1000 / len(group)
                for job in group:
                    warms[job.index].finish(stored[job.index], share)
                computed_bytes += int(sum(stored.values()) * per_token)
                memory_mib = self._cache.store.memory_tier.used_bytes / 1024**2
                bar.set_postfix_str(f"{computed_bytes / 1024**2:.0f} MiB K/V, memory {memory_mib:.0f} MiB", refresh=False)
                bar.update(len(group))
        kept_in = {record.digest: self._cache.kept_in(record) for record in records}
        results = [warm.result().model_copy(update={"kept_in": kept_in[warm.record.digest]}) for warm in warms]
        kept, by_tier = kept_summary(list(kept_in.values()))
        line = summary_line(len(kept_in), kept, by_tier, computed_bytes)
        if kept < len(kept_in):
            _warnings.warning("documents-lost-in-warm", "%s", line)
        else:
            logger.info("%s", line)
        return results

    def _warn_if_corpus_does_not_fit(self, records: Sequence[DocumentRecord]) -> None:
        """Warn (once a minute at most) when the documents' K/V exceed what the tiers keep."""
        fit = self._cache.corpus_fit(records)
        if fit is not None and not fit.fits:
            _warnings.warning("corpus-too-large", "%s", fit.warning())
        elif fit is not None and not fit.fits_memory:
            logger.info("%s", fit.overflow_line())

    def _warm_batch(self, group: list[WarmJob]) -> dict[int, int]:
        """Compute and store a group of documents: one forward pass when there are several
        (and the document context is stored whole), else one prefill each."""
        with self._turns.prompt_work():
            if len(group) > 1:
                stored = self._batch_warmer.run(group)
                if stored is not None:
                    return stored
            return {job.index: self._warm_one(job.plan) for job in group}

    def _warm_one(self, plan: PromptPlan) -> int:
        outcome = self._prefiller.run(plan)
        return self._cache.write_back(plan, outcome, store_documents=True).document_tokens

    def is_document_warm(self, text: str) -> bool:
        """Whether every chunk of ``text`` is cached and its record is stored.

        A read-only check: it stores and computes nothing.
        """
        if not isinstance(text, str) or not text:
            return False
        record = self._cache.registry.lookup(text)
        return record is not None and not self._cache.missing_chunks(record)

    def _remember_context_documents(self, records: list[DocumentRecord]) -> None:
        """Keep the first distinct documents warmed (one more than ``warm_context_documents``,
        so that each of them has others to be warmed behind), skipping documents too long to
        leave room in the context window."""
        wanted = self.settings.warm_context_documents
        if not wanted:
            return
        longest = self.context_window // (4 * wanted)
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
            return PromptTokens("", [], [])
        self._warm_beginning(lead_in)
        return self._prompt_tokens(lead_in, "document context")

    def _plan_document_warm(self, record: DocumentRecord, lead: PromptTokens | None) -> _DocumentWarm:
        """What warming ``record`` behind ``lead`` takes: nothing when its chunks are stored,
        else a plan of the lead-in then the document's own tokens (a warm is a prefill with no
        decoding; ``lead`` is ``None`` only when no document of the call needs computing)."""
        start = time.perf_counter()
        text = record.text
        lead = lead if lead is not None else PromptTokens("", [], [])
        n = len(record.token_ids)
        size = record.chunk_size
        usable = max(0, min(n, self.context_window - len(lead) - 1))
        if usable < n:
            _warnings.warning(
                "long-document",
                "a document of %d tokens does not fit the context window after the document context; "
                "warming its first %d tokens",
                n,
                usable,
            )
        whole = [c for c in range(len(record.chunk_keys)) if min((c + 1) * size, n) <= usable]
        missing = [c for c in whole if not self._cache.store.contains(record.chunk_keys[c])]
        cached_tokens = sum(min(size, n - c * size) for c in whole if c not in missing)
        warm = _DocumentWarm(record=record, cached_tokens=cached_tokens, already_warm=not missing, started=start)
        if missing and self._adapter.position_independent:
            end = whole[-1] * size + min(size, n - whole[-1] * size)
            part = text[: record.offsets[end - 1][1]]
            shift = len(lead.text)
            tokens = PromptTokens(
                lead.text + part,
                lead.ids + list(record.token_ids[:end]),
                lead.offsets + [(x + shift, y + shift) for x, y in record.offsets[:end]],
            )
            placed = DocumentOccurrence(record, shift, len(part))
            plan = self._plan(tokens, placed=[placed], content_reuse=False, lookup_limit=len(lead))
            warm.job = WarmJob(index=-1, plan=plan)
        else:
            warm.elapsed_ms = (time.perf_counter() - start) * 1000
        return warm

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str, options: GenerationOptions | None = None, **overrides: Any) -> GenerationResult:
        """Generate a completion of ``prompt``, reusing cached K/V where possible.

        Concurrent calls (threads, async integrations) decode together: each request joins
        the running batch at the next decode step (see ``max_batch_size``).

        Args:
            prompt: The full prompt text.
            options: Decoding and reuse options (defaults when omitted).
            **overrides: Fields of :class:`~kvboost_rag.options.GenerationOptions`
                (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``reuse``,
                ``documents``, ``return_logits``, ``constraint``), applied over ``options``.

        Raises:
            InvalidInputError: Empty prompt, bad options (the message names the field), an
                invalid constraint, or a constraint without llguidance installed.
            PromptTooLongError: The prompt does not fit the context window.
        """
        stream = self.stream(prompt, options, **overrides)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str, options: GenerationOptions | None = None, **overrides: Any) -> GenerationStream:
        """Like :meth:`generate`, yielding text pieces as they decode.

        Input is validated here, before iteration starts. ``stream.result`` holds the
        :class:`GenerationResult` once the iterator is exhausted.
        """
        start = time.perf_counter()
        resolved = GenerationOptions.resolve(options, overrides)
        tokens = self._prompt_tokens(prompt)
        _check_documents(resolved)
        guide = None
        if resolved.constraint is not None:
            guide = self._constraints.compile(resolved.constraint, self._output_budget(len(tokens), resolved))
        stream = GenerationStream(iter(()))
        stream._pieces = self._run(stream, tokens, resolved, start, guide)
        return stream

    def min_new_tokens(self, constraint: OutputConstraint | Mapping[str, Any]) -> int | None:
        """The smallest ``max_new_tokens`` a call constrained by ``constraint`` accepts: the
        tokens of the shortest valid output (end of sequence excluded). Any budget from it up
        gives a valid output; a smaller one is an :class:`InvalidInputError` naming it.

        Args:
            constraint: An :class:`~kvboost_rag.constrained.OutputConstraint` or a dict of its
                fields (what ``generate(..., constraint=...)`` takes).

        Returns:
            The minimum, or ``None`` when the engine finds no way to close this constraint's
            outputs (then any budget is accepted and the output is not closed within it).

        Raises:
            InvalidInputError: An invalid constraint, or llguidance not installed.
        """
        resolved = GenerationOptions.resolve(None, {"constraint": constraint}).constraint
        assert resolved is not None
        return self._constraints.minimum_tokens(resolved)

    def generate_batch(
        self, prompts: Sequence[str], options: GenerationOptions | None = None, **overrides: Any
    ) -> list[GenerationResult | Exception]:
        """Generate completions of several prompts, decoding them together.

        Each prompt is prefilled with its own reuse (prefix hits, document hits and repair,
        as :meth:`generate`), in order. A leading part several prompts share (at least
        ``chunk_size`` tokens) that no tier holds yet is computed once first and stored, so
        each prompt reads it as an exact prefix hit. Then all decode together, one forward pass per step,
        each with its own stop strings, EOS and token budget; a finished prompt leaves the
        batch. Greedy outputs equal those of :meth:`generate` on each prompt alone. At most
        ``max_batch_size`` prompts (and ``max_batch_cache_bytes`` of K/V) decode at once;
        the others join as places free up, and concurrent calls share the same batch.

        Args:
            prompts: Full prompt texts.
            options: Decoding and reuse options for every prompt (defaults when omitted).
            **overrides: Fields of :class:`~kvboost_rag.options.GenerationOptions`, applied
                over ``options``.

        Returns:
            One entry per prompt, in order: its :class:`GenerationResult` (``ttft_ms`` is the
            wall time from this call to that prompt's first token, ``total_ms`` to its last;
            usage and reuse figures are the prompt's own), or the exception that failed that
            prompt alone: an :class:`InvalidInputError` for bad input (an empty prompt, a lone
            surrogate), a :class:`PromptTooLongError`, or what ended its decoding.

        Raises:
            InvalidInputError: ``prompts`` is one string, or the options are bad (they are
                shared by every prompt).
        """
        start = time.perf_counter()
        if isinstance(prompts, (str, bytes)):
            raise InvalidInputError("generate_batch takes a list of prompts, not one string: pass [prompt]")
        prompts = list(prompts)
        resolved = GenerationOptions.resolve(options, overrides)
        _check_documents(resolved)
        if resolved.constraint is not None:
            # Shared by every prompt: a bad one, or too small a budget for it, fails the call.
            self._constraints.compile(resolved.constraint, resolved.max_new_tokens)
        outputs: list[GenerationResult | Exception | None] = [None] * len(prompts)
        started: list[tuple[int, _Request]] = []

        def submit_all() -> None:
            # The prefilled prompts join the batch together (and before a prefill waits for
            # a place, so the places they hold can free up).
            _submit_together([request for _, request in started], self._scheduler)

        tokenized: list[tuple[int, PromptTokens]] = []
        for i, prompt in enumerate(prompts):
            try:
                tokenized.append((i, self._prompt_tokens(prompt, f"prompt {i}")))
            except KVBoostError as error:
                outputs[i] = error
        if resolved.reuse:
            self._store_common_beginning([tokens for _, tokens in tokenized])
        try:
            for i, tokens in tokenized:
                try:
                    started.append((i, self._start(tokens, resolved, start, hold=True, on_wait=submit_all)))
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
                request.close(self._scheduler)
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
        plan = self._plan(tokens, content_reuse=False, lookup_limit=common)
        with self._turns.prompt_work():
            outcome = self._prefiller.run(plan)
        if outcome.logits is not None:  # something was computed: store it
            self._cache.write_back(plan, outcome, store_documents=False)

    def _run(
        self,
        stream: GenerationStream,
        tokens: PromptTokens,
        options: GenerationOptions,
        start: float,
        guide: GrammarGuide | None = None,
    ) -> Iterator[str]:
        """text -> plan -> lookup/stitch/repair -> decode (batched) -> write-back, in that order."""
        request = self._start(tokens, options, start, guide=guide)
        try:
            stream.result = yield from self._follow(request, end_at_last_token=False)
        finally:
            request.close(self._scheduler)

    def _start(
        self,
        tokens: PromptTokens,
        options: GenerationOptions,
        start: float,
        *,
        hold: bool = False,
        on_wait: Callable[[], None] | None = None,
        guide: GrammarGuide | None = None,
    ) -> _Request:
        """Plan and prefill a prompt and choose its first token, after waiting for a place in
        the batch.

        Args:
            tokens: The prompt.
            options: Its options.
            start: ``perf_counter`` at the call.
            hold: Keep the sequence until :meth:`_Request.submit` (a batch joins at once);
                else it is handed to the decode worker now (unless its first token ended it).
            on_wait: Called once if the request must wait for a place.
            guide: The state of the output constraint, already compiled (else compiled here
                from ``options.constraint``, when set: every sequence has its own).
        """
        n = len(tokens)
        budget = self._output_budget(n, options)
        if guide is None and options.constraint is not None:
            guide = self._constraints.compile(options.constraint, budget)
        plan = self._plan_generation(tokens, options, budget)
        reservation = self._scheduler.reserve(self._kv_bytes(n + budget), on_wait=on_wait)
        try:
            with self._turns.prompt_work():
                outcome = self._prefiller.run(plan, reuse=options.reuse)
            if options.reuse:
                self._cache.record(plan, outcome)
                self._warn_if_documents_missed(plan, outcome)
            sequence = DecodeSequence(
                cache=outcome.cache,
                position=n,
                budget=budget,
                options=options,
                sampling=SequenceSampling(make_generator(options.seed, self._adapter.device), guide),
                assembler=TextAssembler(self.tokenizer, options.stop),
                eos_ids=self._eos_ids,
            )
            first_pieces = sequence.choose(outcome.logits)
        except BaseException:
            self._scheduler.release(reservation)
            raise
        ttft_ms = (time.perf_counter() - start) * 1000
        request = _Request(plan, options, start, outcome, sequence, ttft_ms, first_pieces, reservation)
        if sequence.done:
            request.close(self._scheduler)
        elif not hold:
            request.submit(self._scheduler)
        return request

    def _output_budget(self, prompt_tokens: int, options: GenerationOptions) -> int:
        """Most tokens a prompt of ``prompt_tokens`` may generate: ``max_new_tokens``, or what
        the context window leaves."""
        return min(options.max_new_tokens, self.context_window - prompt_tokens)

    def _follow(self, request: _Request, *, end_at_last_token: bool) -> Iterator[str]:
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
        finally:
            request.close(self._scheduler)
            if options.reuse:
                self._cache.write_back(plan, outcome, store_documents=self._stores_documents)
        end = sequence.finished_at if end_at_last_token and sequence.finished_at is not None else time.perf_counter()
        guide = sequence.sampling.guide
        if guide is not None and sequence.finish_reason == "length" and not guide.complete:
            _warnings.warning(
                "constraint-cut",
                "constrained output reached max_new_tokens=%d before its grammar completed; "
                "raise max_new_tokens (finish_reason='length')",
                options.max_new_tokens,
            )
        token_ids = sequence.assembler.trimmed_token_ids()
        n = plan.num_tokens
        # Only K/V that was loaded and kept counts: tokens the repair recomputed were computed here.
        cached = outcome.prefix_tokens + outcome.content_tokens - outcome.recomputed_tokens
        return GenerationResult(
            output_text=sequence.assembler.text,
            token_ids=token_ids,
            generated_tokens=len(token_ids),
            finish_reason=sequence.finish_reason or "length",
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
            step_logits=torch.stack(sequence.step_logits) if sequence.step_logits else None,
        )

    def _kv_bytes(self, tokens: int) -> int:
        """Bytes of the K and V buffers of ``tokens`` positions."""
        layout = self._adapter.layout
        element = torch.empty((), dtype=self._adapter.dtype).element_size()
        return 2 * layout.layers * layout.kv_heads * layout.head_dim * element * tokens

    def _plan_generation(self, tokens: PromptTokens, options: GenerationOptions, budget: int) -> PromptPlan:
        if not options.reuse:
            return self._plan(tokens, registry=None, content_reuse=False, reserve=budget)
        records = [self._document_record(d) for d in options.documents]
        content = self._content_reuse_allowed(len(tokens) + options.max_new_tokens)
        return self._plan(tokens, explicit=records, content_reuse=content, reserve=budget)

    def _warn_if_documents_missed(self, plan: PromptPlan, outcome: PrefillOutcome) -> None:
        """Log (rate-limited) why a prompt with a long computed part held no prewarmed
        document, or held documents that were warmed and then evicted."""
        if not plan.content_reuse or outcome.live_tokens < self.settings.chunk_size:
            return
        evicted = self._cache.evicted_in(plan.tokens.text)
        if evicted:
            _warnings.warning(
                "documents-evicted",
                "a prompt of %d tokens (%d computed) holds %d document(s) that were warmed and then evicted "
                "from the cache: %s",
                plan.num_tokens,
                outcome.live_tokens,
                evicted,
                explain_evicted_documents(
                    self._cache.counters["documents_evicted"], self._cache.store.memory_tier.max_bytes, len(self._cache.store.tiers) > 1
                ),
            )
            return
        documents = len(self._cache.registry)
        if plan.documents or not plan.content_reuse or not documents or outcome.live_tokens < self.settings.chunk_size:
            return
        _warnings.warning(
            "no-documents-found",
            "%d documents are prewarmed but none was found in a prompt of %d tokens (%d computed): %s",
            documents,
            plan.num_tokens,
            outcome.live_tokens,
            explain_missed_documents(plan.tokens.text, self._cache.registry),
        )

    @property
    def _stores_documents(self) -> bool:
        return self.settings.store_generated_documents and self._adapter.position_independent

    def _content_reuse_allowed(self, total_tokens: int) -> bool:
        if not self._adapter.position_independent:
            return False
        window = self._adapter.sliding_window
        if window is not None and total_tokens > window:
            message = (
                f"prompt plus new tokens ({total_tokens}) exceed the sliding window ({window}); "
                "documents are not reused at new positions for this prompt"
            )
            if self.settings.strict:
                raise UnsupportedModelError(message)
            _warnings.warning("window-exceeded", message)
            return False
        return True

    def _logits_width(self) -> int:
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        if weight is not None:
            return int(weight.shape[0])
        return int(getattr(self.model.config, "vocab_size", None) or len(self.tokenizer))

    # ------------------------------------------------------------------ checks and stats
    def verify_correctness(
        self, prompts: Sequence[str], max_new_tokens: int = 32, kl_tolerance: float = 0.05
    ) -> CorrectnessReport:
        """Compare the reuse path with full prefill on your own prompts (greedy).

        Args:
            prompts: Prompts to check (documents in them should be warmed first).
            max_new_tokens: Tokens to generate for the output comparison.
            kl_tolerance: Mean first-token KL under which the report passes.
        """
        if not prompts:
            raise InvalidInputError("verify_correctness needs at least one prompt")
        pairs = []
        for prompt in prompts:
            full = self.generate(prompt, max_new_tokens=max_new_tokens, reuse=False, return_logits=True)
            reused = self.generate(prompt, max_new_tokens=max_new_tokens, reuse=True, return_logits=True)
            pairs.append((full, reused))
        return compare_runs(pairs, kl_tolerance)

    def refresh_documents(self) -> int:
        """Find the documents other processes stored in the shared disk folder or Redis since
        this engine started (an engine finds those stored before it started on its own).

        Reads key names only. Returns the number of documents now known.
        """
        return self._cache.attach_stored_documents()

    def cache_stats(self) -> CacheStats:
        """Counters of the cache and its tiers."""
        store = self._cache.store
        memory = self._cache.store.memory_tier
        return CacheStats(
            entries=len(list(memory.keys())),
            memory_bytes=memory.used_bytes,
            index_bytes=self._cache.index_bytes,
            prefix_index_entries=len(self._cache.prefix_index),
            documents=len(self._cache.registry),
            documents_evicted=self._cache.counters["documents_evicted"],
            documents_by_tier=self._cache.documents_by_tier(),
            tiers=store.stats(),
            misses=store.misses,
            counters=dict(self._cache.counters),
        )

    def clear_cache(self) -> None:
        """Drop every cached entry and registered document."""
        self._cache.clear()


def _check_text(text: object, what: str) -> None:
    """Reject text the tokenizer cannot read, with an error that names the fix."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(f"{what} must be a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{what} holds a lone surrogate at character {exc.start} ({text[exc.start]!r}), which is not "
            "valid Unicode text: decode your source with errors='replace' or strip surrogates"
        ) from None


def _check_documents(options: GenerationOptions) -> None:
    """Reject explicit documents the tokenizer cannot read."""
    for i, document in enumerate(options.documents):
        _check_text(document, f"documents[{i}]")


def _check_device(device: str) -> None:
    """Fail early, and clearly, when the settings name a device this machine lacks."""
    kind = device.split(":", 1)[0]
    available = {
        "cpu": True,
        "cuda": torch.cuda.is_available(),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
        "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if not available.get(kind, False):
        raise InvalidInputError(f"device={device!r} but this machine has no {kind} device; use device='cpu' or None")
