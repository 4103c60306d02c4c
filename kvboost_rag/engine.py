"""The engine facade: the one entry point users and integrations call."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvboost_rag.cache_manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.correctness import compare_runs
from kvboost_rag.errors import (
    InvalidInputError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from kvboost_rag.generate import (
    SamplingParams,
    TextAssembler,
    make_generator,
    sample_token,
)
from kvboost_rag.hashing import text_digest
from kvboost_rag.model_adapter import ModelAdapter
from kvboost_rag.prefill import Prefiller, PrefillOutcome, TokenizedPrompt
from kvboost_rag.results import (
    CacheStats,
    CorrectnessReport,
    GenerationResult,
    WarmResult,
)
from kvboost_rag.segments import ANCHOR_CHARS
from kvboost_rag.storage import build_store

logger = logging.getLogger(__name__)

#: Text documents are warmed behind when no ``warm_prefix`` is set, so a document's first
#: tokens are not computed at position 0 (where they would act as attention sinks).
DEFAULT_DOCUMENT_LEAD_IN = "Reference documents:\n\n"


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


class KVBoost:
    """Reuses the K/V of text the model has already read.

    Build it with :meth:`from_pretrained` or :meth:`from_model`. Safe to call from several
    threads: model calls are serialized, cache lookups are locked.

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
        # The text documents are warmed behind changes their K/V only as much as any other
        # context would: it is not part of the namespace, so documents hit under any prompt.
        extra = [f"bits={self.settings.kv_cache_bits}", f"group={self.settings.kv_group_size}"]
        self.fingerprint = self._adapter.fingerprint(extra)
        self._cache = CacheManager(
            store=build_store(self.settings),
            fingerprint=self.fingerprint,
            layout=self._adapter.layout,
            settings=self.settings,
            tokenize=self.token_ids_with_offsets,
            device=self._adapter.device,
            dtype=self._adapter.dtype,
        )
        self._prefiller = Prefiller(self._adapter, self._cache, self.settings)
        self._model_lock = threading.RLock()
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

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's chat template.

        Raises:
            UnsupportedModelError: The tokenizer has no chat template.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise UnsupportedModelError("this tokenizer has no chat template; pass a plain prompt instead")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)

    def _tokenize_prompt(self, prompt: str) -> TokenizedPrompt:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidInputError("prompt must be a non-empty string")
        enc = self.tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if not ids:
            raise InvalidInputError("prompt has no tokens")
        if len(ids) >= self.context_window:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the model's context window is {self.context_window}: "
                "retrieve fewer or shorter documents"
            )
        return TokenizedPrompt(prompt, ids, [tuple(o) for o in enc["offset_mapping"]])

    # ------------------------------------------------------------------ warming
    def warm(self, text: str) -> WarmResult:
        """Cache ``text`` as a shared beginning (system prompt); prompts starting with it hit exactly.

        Warmed beginnings are pinned: eviction never drops them. Unless ``warm_prefix`` is
        set, documents warmed afterwards are computed behind the most recently warmed text.
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
        prompt = self._tokenize_prompt(text)
        ids = prompt.ids
        with self._model_lock:
            pieces = self._cache.match_prefix(ids)
            cached = sum(p.length for p in pieces)
            if cached < len(ids):
                outcome = self._prefiller.with_reuse(prompt, [], allow_content=False, extra=0)
                keys, values = ModelAdapter.cache_tensors(outcome.cache)
            else:
                keys = torch.cat([p.block.keys[:, :, : p.length] for p in pieces], dim=2)
                values = torch.cat([p.block.values[:, :, : p.length] for p in pieces], dim=2)
        self._cache.store_prefix(ids, keys, values, len(ids), pinned=True)
        chunks = self._cache.prefix_chunks(ids, len(ids))
        return WarmResult(
            kind="prefix",
            num_tokens=len(ids),
            new_tokens=len(ids) - cached,
            cached_tokens=cached,
            already_warm=cached == len(ids),
            elapsed_ms=(time.perf_counter() - start) * 1000,
            prefix_hash=chunks[-1][0],
        )

    def warm_documents(self, texts: Iterable[str], show_progress: bool | None = None) -> list[WarmResult]:
        """Cache documents so they hit by content hash wherever they land in a prompt.

        Each document is computed behind :attr:`document_context` (so its first tokens are not
        attention sinks; ideally the system prompt that precedes documents in your prompts)
        and stored in ``chunk_size`` pieces. Documents already cached are registered without
        computing anything.

        Args:
            texts: Document texts, exactly as they will appear in prompts.
            show_progress: Progress bar (default: ``settings.show_progress``, and only for
                more than one document).

        Raises:
            InvalidInputError: A document is empty.
        """
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise InvalidInputError(f"document {i} is empty; every document needs text")
        short = sum(1 for text in texts if len(text) < ANCHOR_CHARS)
        if short:
            logger.warning(
                "%d document(s) shorter than %d characters are cached but found in prompts only "
                "when passed to generate(documents=...)",
                short,
                ANCHOR_CHARS,
            )
        progress = self.settings.show_progress if show_progress is None else show_progress
        lead = self._lead_in_cache()
        results = []
        for text in tqdm(texts, desc="warming documents", unit="doc", disable=not progress or len(texts) < 2):
            results.append(self._warm_document(text, lead))
        return results

    def is_document_warm(self, text: str) -> bool:
        """Whether every chunk of ``text`` is cached and the document is registered.

        A read-only check: it registers nothing.
        """
        if not text:
            return False
        record = self._cache.registry.get(text_digest(text))
        return record is not None and not self._cache.missing_chunks(record)

    def _lead_in_cache(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        lead_in = self.document_context
        if not lead_in.strip():
            return [], torch.empty(0), torch.empty(0)
        ids = self._tokenize_prompt(lead_in).ids
        self._warm_beginning(lead_in)
        pieces = self._cache.match_prefix(ids)
        keys = torch.cat([p.block.keys[:, :, : p.length] for p in pieces], dim=2)
        values = torch.cat([p.block.values[:, :, : p.length] for p in pieces], dim=2)
        return ids[: keys.shape[2]], keys, values

    def _warm_document(self, text: str, lead: tuple[list[int], torch.Tensor, torch.Tensor]) -> WarmResult:
        start = time.perf_counter()
        record = self._cache.document_record(text)
        missing = self._cache.missing_chunks(record)
        n = len(record.token_ids)
        if missing and self._adapter.position_independent:
            lead_ids, lead_keys, lead_values = lead
            offset = len(lead_ids)
            limit = self.context_window - offset
            if n > limit:
                logger.warning("document of %d tokens exceeds the context window; warming its first %d", n, limit)
            usable = min(n, limit)
            keys, values = self._adapter.buffers(offset + usable)
            if offset:
                keys[:, :, :offset], values[:, :, :offset] = lead_keys, lead_values
            with self._model_lock:
                kv = self._adapter.cache_over(keys, values, offset)
                self._adapter.forward(torch.tensor(record.token_ids[:usable]), torch.arange(offset, offset + usable), kv)
            keys, values = keys[:, :, offset:], values[:, :, offset:]
            size = record.chunk_size
            for chunk in missing:
                lo, hi = chunk * size, min((chunk + 1) * size, n)
                if hi > usable:
                    break
                self._cache.store_document_chunk(record, chunk, keys[:, :, lo:hi], values[:, :, lo:hi], offset + lo)
        new_tokens = sum(min(record.chunk_size, n - c * record.chunk_size) for c in missing)
        return WarmResult(
            kind="document",
            num_tokens=n,
            new_tokens=new_tokens,
            cached_tokens=n - new_tokens,
            already_warm=not missing,
            elapsed_ms=(time.perf_counter() - start) * 1000,
            content_hash=record.chunk_keys[0] if record.chunk_keys else None,
        )

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        reuse: bool = True,
        documents: Sequence[str] | None = None,
        return_logits: bool = False,
    ) -> GenerationResult:
        """Generate a completion of ``prompt``, reusing cached K/V where possible.

        Args:
            prompt: The full prompt text.
            max_new_tokens: Upper bound on generated tokens.
            temperature: 0 for greedy decoding.
            top_p: Nucleus sampling mass.
            seed: Seed for sampling.
            stop: Strings that end the output; it is cut before the first one.
            reuse: ``False`` runs full prefill through the same code path (the baseline).
            documents: Texts the caller knows are in the prompt; cut on their boundaries and
                stored for next time even if never warmed.
            return_logits: Fill ``first_token_logits``.

        Raises:
            InvalidInputError: Empty prompt, bad sampling parameters.
            PromptTooLongError: The prompt does not fit the context window.
        """
        stream = self.stream(
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            reuse=reuse,
            documents=documents,
            return_logits=return_logits,
        )
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: str,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        reuse: bool = True,
        documents: Sequence[str] | None = None,
        return_logits: bool = False,
    ) -> GenerationStream:
        """Like :meth:`generate`, yielding text pieces as they decode.

        Input is validated here, before iteration starts. ``stream.result`` holds the
        :class:`GenerationResult` once the iterator is exhausted.
        """
        start = time.perf_counter()
        params = SamplingParams(max_new_tokens, float(temperature), float(top_p), seed, tuple(stop or ()))
        tokenized = self._tokenize_prompt(prompt)
        if documents is not None and (isinstance(documents, str) or not all(isinstance(d, str) for d in documents)):
            raise InvalidInputError("documents must be a list of strings")
        stream = GenerationStream(iter(()))
        stream._pieces = self._run(stream, tokenized, params, reuse, [d for d in documents or () if d], return_logits, start)
        return stream

    def _run(
        self,
        stream: GenerationStream,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        reuse: bool,
        documents: list[str],
        return_logits: bool,
        start: float,
    ) -> Iterator[str]:
        n = len(prompt.ids)
        budget = min(params.max_new_tokens, self.context_window - n)
        with self._model_lock:
            outcome = self._prefill(prompt, params, reuse, documents)
        generator = make_generator(params.seed, self._adapter.device)
        token = sample_token(outcome.logits, params, generator)
        ttft_ms = (time.perf_counter() - start) * 1000
        if reuse:
            self._store_after_prefill(prompt, outcome)
        assembler = TextAssembler(self.tokenizer, params.stop)
        eos = self._eos_ids()
        finish = "length"
        position = n
        produced = 0
        while True:
            if token in eos:
                finish = "eos"
                break
            produced += 1
            piece = assembler.add(token)
            if piece:
                yield piece
            if assembler.stopped:
                finish = "stop"
                break
            if produced >= budget:
                break
            with self._model_lock:
                logits = self._adapter.forward(torch.tensor([token]), torch.tensor([position]), outcome.cache)
            position += 1
            token = sample_token(logits, params, generator)
        rest = assembler.finish()
        if rest:
            yield rest
        token_ids = assembler.trimmed_token_ids()
        cached = outcome.prefix_tokens + outcome.content_tokens
        stream.result = GenerationResult(
            output_text=assembler.text,
            token_ids=token_ids,
            generated_tokens=len(token_ids),
            finish_reason=finish,
            ttft_ms=ttft_ms,
            total_ms=(time.perf_counter() - start) * 1000,
            prompt_tokens=n,
            cached_tokens=cached,
            prefix_hit_tokens=outcome.prefix_tokens,
            content_hit_tokens=outcome.content_tokens,
            recomputed_tokens=outcome.recomputed_tokens,
            live_tokens=outcome.live_tokens,
            boundary_merged_tokens=outcome.merged_tokens,
            documents_found=len(outcome.occurrences),
            kv_reuse_ratio=cached / n,
            strategy=outcome.strategy,
            first_token_logits=outcome.logits.detach().cpu() if return_logits else None,
        )

    def _prefill(self, prompt: TokenizedPrompt, params: SamplingParams, reuse: bool, documents: list[str]) -> PrefillOutcome:
        extra = min(params.max_new_tokens, self.context_window - len(prompt.ids))
        if not reuse:
            return self._prefiller.full(prompt, extra)
        records = [self._cache.document_record(d) for d in documents]
        allow_content = self._content_reuse_allowed(len(prompt.ids) + params.max_new_tokens)
        outcome = self._prefiller.with_reuse(prompt, records, allow_content, extra)
        self._cache.count("prompts")
        self._cache.count("prompt_tokens", len(prompt.ids))
        self._cache.count("prefix_hit_tokens", outcome.prefix_tokens)
        self._cache.count("content_hit_tokens", outcome.content_tokens)
        self._cache.count("recomputed_tokens", outcome.recomputed_tokens)
        self._cache.count("boundary_merged_tokens", outcome.merged_tokens)
        return outcome

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
            logger.warning(message)
            return False
        return True

    def _store_after_prefill(self, prompt: TokenizedPrompt, outcome: PrefillOutcome) -> None:
        """Store the exact leading K/V as prefix chunks and new documents as content chunks."""
        first_doc = min((self._first_token(prompt, o.char_start) for o in outcome.occurrences), default=len(prompt.ids))
        prefix_end = min(outcome.exact_until, first_doc, len(prompt.ids))
        new_docs = []
        if self.settings.store_generated_documents and self._adapter.position_independent:
            new_docs = [(o, self._cache.missing_chunks(o.record)) for o in outcome.occurrences]
            new_docs = [(o, m) for o, m in new_docs if m]
        if prefix_end <= outcome.prefix_tokens and not new_docs:
            return
        keys, values = ModelAdapter.cache_tensors(outcome.cache, 0, len(prompt.ids))
        if prefix_end > outcome.prefix_tokens:
            self._cache.store_prefix(prompt.ids, keys, values, prefix_end)
        for occurrence, missing in new_docs:
            self._store_document_from_prompt(occurrence, missing, keys, values)

    def _store_document_from_prompt(self, occurrence, missing: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        record = occurrence.record
        where = dict((k, j) for j, k in occurrence.aligned)
        size = record.chunk_size
        for chunk in missing:
            lo, hi = chunk * size, min((chunk + 1) * size, len(record.token_ids))
            positions = [where.get(k) for k in range(lo, hi)]
            if any(p is None for p in positions) or positions[-1] - positions[0] != hi - lo - 1:
                continue  # not wholly in this prompt, or split by a boundary merge
            first = positions[0]
            self._cache.store_document_chunk(
                record, chunk, keys[:, :, first : first + hi - lo], values[:, :, first : first + hi - lo], first
            )

    @staticmethod
    def _first_token(prompt: TokenizedPrompt, char: int) -> int:
        for j, (s, e) in enumerate(prompt.offsets):
            if e > char:
                return j
        return len(prompt.ids)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

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

    def cache_stats(self) -> CacheStats:
        """Counters of the cache and its tiers."""
        store = self._cache.store
        memory = store.tiers[0]
        return CacheStats(
            entries=len(list(memory.keys())),
            memory_bytes=memory.used_bytes,
            documents=len(self._cache.registry),
            tiers=store.stats(),
            misses=store.misses,
            counters=dict(self._cache.counters),
        )

    def clear_cache(self) -> None:
        """Drop every cached entry and registered document."""
        self._cache.clear()
