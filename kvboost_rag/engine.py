"""The engine facade: builds the parts (``kvboost_rag/README.md`` maps them) and delegates."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvboost_rag import c_heap
from kvboost_rag.cache.device_memory import DeviceMemoryPlan, device_memory_plan
from kvboost_rag.cache.manager import STATS_FLUSH_SECONDS, CacheManager, queued_bytes_bound
from kvboost_rag.cache.storage import build_store
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.decode.constrained import ConstraintCompiler, OutputConstraint
from kvboost_rag.decode.sampling import eos_token_ids
from kvboost_rag.decode.draft_policy import DraftPolicy
from kvboost_rag.default_model import cache_home
from kvboost_rag.hf.captured import build_captured_rows, build_prefill_rows, captured_steps_wanted, probe_buckets
from kvboost_rag.hf.captured.build import unread_decode_copies
from kvboost_rag.hf.captured.graph import keep_compiled_code_in
from kvboost_rag.diagnosis.correctness import compare_runs
from kvboost_rag.errors import (
    InvalidInputError,
    ModelNotFoundError,
    RequestCancelled,
    UnsupportedModelError,
)
from kvboost_rag.engine_loop import BatchPlaces, EngineLoop
from kvboost_rag.generation.host_buffers import HostBufferPool
from kvboost_rag.generation.batch import Batches
from kvboost_rag.generation.holdings import RequestMemory
from kvboost_rag.generation.lifecycle import GenerationStream, Requests
from kvboost_rag.generation.parts import EngineParts
from kvboost_rag.hf import ModelAdapter, ModelFeatures
from kvboost_rag.decode_weights.resident import page_out_input_embeddings
from kvboost_rag.openmp_workers import release_idle_workers
from kvboost_rag.prefill.prefiller import Prefiller
from kvboost_rag.request.chat import ChatTemplate
from kvboost_rag.request.hashing import root_hash
from kvboost_rag.request.inputs import check_device
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import Planner
from kvboost_rag.request.text import Tokenizing
from kvboost_rag.results import (
    CacheStats,
    CorrectnessReport,
    GenerationResult,
    KVMemory,
    WarmResult,
)
from kvboost_rag.warming import Warming

logger = logging.getLogger(__name__)

__all__ = ["GenerationStream", "KVBoost"]


def _check_position_independence(adapter: ModelAdapter, strict: bool) -> None:
    """Raise (``strict``) or warn once when the model's documents cannot be reused at other
    positions (reuse falls back to exact prefixes)."""
    if adapter.position_independent:
        return
    reason = adapter.position_independent_reason
    if strict:
        raise UnsupportedModelError(
            f"position-independent reuse is not possible: {reason} (strict=False falls back to prefix-only reuse)"
        )
    logger.warning("prefix-only reuse for this model: %s; documents are reused only inside an exact prefix", reason)

class KVBoost:
    """Reuses the K/V of text the model has already read.

    Build it with :meth:`from_pretrained` or :meth:`from_model`. Safe to call from several
    threads: one engine loop runs every forward pass (:mod:`kvboost_rag.engine_loop`), each
    step carrying the running answers' next tokens and slices of waiting prompt work
    (prefills, warms), so concurrent generations decode together in one batch and a new
    prompt does not stall the open streams; cache lookups are locked.

    Args:
        model: A transformers causal LM.
        tokenizer: Its fast tokenizer.
        settings: Engine settings.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, settings: KVBoostSettings | None = None) -> None:
        self.settings = settings = settings or KVBoostSettings()
        if model is None:
            raise UnsupportedModelError("a model is required")
        if settings.device is not None:
            check_device(settings.device)
            model = model.to(settings.device)
        self._keep_compiled_code(model, settings)
        self._adapter = adapter = ModelAdapter(model, tokenizer)
        if settings.check_layer >= adapter.num_layers:
            raise InvalidInputError(f"check_layer={settings.check_layer} but the model has {adapter.num_layers} layers")
        self.model, self.tokenizer = adapter.model, tokenizer
        self.model_name = adapter.model_name
        # The text documents are warmed behind changes their K/V only as much as any other
        # context would: it is not part of the namespace, so documents hit under any prompt.
        self.fingerprint = adapter.fingerprint([f"bits={settings.kv_cache_bits}", f"group={settings.kv_group_size}"])
        page_out_input_embeddings(self.model)  # the fingerprint read the whole table; lookups need rows
        memory = self._device_memory_plan(adapter, settings)
        store = build_store(settings, adapter.device, memory.device_tier_bytes)
        self._cache = cache = CacheManager(store, self.fingerprint, adapter.layout, settings, adapter.device, adapter.dtype)
        self._chat = ChatTemplate(tokenizer)
        tokenizing = Tokenizing(tokenizer, adapter, cache.index.known_documents)
        planner = Planner(root_hash(self.fingerprint), settings.chunk_size, cache.index.known_documents)
        self._build_captured(adapter, settings, memory.pool_bytes)
        if self._captured is None:  # eager decode and verify steps: their linear layers' kernel
            adapter.choose_small_row_kernel(settings.small_row_kernels, settings.packed_weights_bytes, settings.decode_weights)
            c_heap.trim()  # the copies' temporaries
        elif (unread := unread_decode_copies(adapter, settings.decode_weights)) is not None:
            logger.warning("%s", unread)
        prefiller = Prefiller(
            adapter, cache, settings, captured=self._captured_prefill, captured_probe=self._captured_probe
        )
        self._places = BatchPlaces(settings)
        drafts = DraftPolicy(settings, adapter.device.type)
        self._loop = EngineLoop(adapter, settings, self._places, drafts, self._captured)
        eos_ids = eos_token_ids(self.model, tokenizer)
        self._constraints = ConstraintCompiler(tokenizer, adapter.vocab_width, eos_ids)
        parts = EngineParts(adapter, cache, settings, tokenizing, planner, prefiller, self._loop)
        self._warming = Warming(parts)
        self._requests = Requests(parts, self._request_memory(adapter, settings), self._constraints, eos_ids)
        self._batches = Batches(self._requests)
        self._tokenizing = tokenizing
        _check_position_independence(adapter, settings.strict)
        # The loading thread's OpenMP workers (loading and the checks at load ran torch on it):
        # while they exist the engine loop's workers sleep between parallel regions. A server
        # whose requests arrive on other threads would otherwise never give them back.
        release_idle_workers()

    def _request_memory(self, adapter: ModelAdapter, settings: KVBoostSettings) -> RequestMemory:
        """Where requests' K/V buffers come from: the captured steps' slots, or on a CPU host
        buffers reused across requests (fresh ones page-fault on every call), idle ones kept
        within a quarter of the decode budget."""
        slots = None if self._captured is None else self._captured.pool
        host_buffers = (
            HostBufferPool(adapter.buffers, settings.max_batch_cache_bytes // 4, settings.max_batch_cache_bytes)
            if adapter.device.type == "cpu"
            else None
        )
        return RequestMemory(self._places, adapter.kv_bytes_per_token, slots, host_buffers)

    @staticmethod
    def _keep_compiled_code(model: torch.nn.Module, settings: KVBoostSettings) -> None:
        """Where the engine compiles (captured steps; FlexAttention on CUDA), keep torch's
        compile caches in the engine's cache folder, so a later process reuses the code."""
        parameter = next(model.parameters(), None)
        device = torch.device("cpu") if parameter is None else parameter.device
        if device.type == "cuda" or captured_steps_wanted(settings.captured_steps, device):
            logger.info("compiled code kept in %s", keep_compiled_code_in(cache_home() / "torch-compile"))

    def _build_captured(self, adapter: ModelAdapter, settings: KVBoostSettings, pool_bytes: int) -> None:
        """Decode and draft-verify steps as compiled graphs (CUDA graphs on CUDA) over a pool of
        ``pool_bytes``, and with ``captured_prefill_buckets`` prefill passes too, built when the
        engine loads (``captured_build``: in the background, or before this returns), never on
        a request; ``None`` each where they are not used (eager)."""
        background = settings.captured_build == "background"
        self._captured = build_captured_rows(
            adapter, settings.captured_steps, pool_bytes, settings.captured_token_buckets,
            scratch_tokens=max((*settings.captured_token_buckets, *settings.captured_prefill_buckets)),
            background=background,
        )
        # The probe records attention over the whole pool: its own passes, so the others skip that.
        prefill_buckets = settings.captured_prefill_buckets
        self._captured_prefill = build_prefill_rows(self._captured, prefill_buckets, background=background)
        self._captured_probe = None
        if self._captured_prefill is not None:
            self._captured_probe = build_prefill_rows(
                self._captured, probe_buckets(prefill_buckets), record_queries=settings.probe_queries,
                background=background, after=self._captured_prefill,
            )

    @staticmethod
    def _device_memory_plan(adapter: ModelAdapter, settings: KVBoostSettings) -> DeviceMemoryPlan:
        """The captured steps' pool and the device tier sized together, by the one rule of
        :func:`~kvboost_rag.cache.device_memory.device_memory_plan`."""
        plan = device_memory_plan(
            settings, adapter.device, adapter.kv_bytes_per_token, adapter.context_window,
            captured=captured_steps_wanted(settings.captured_steps, adapter.device),
            staged_bytes=queued_bytes_bound(settings),
        )
        logger.info(
            "device memory: captured steps' pool %.1f GiB, device tier %.1f GiB",
            plan.pool_bytes / 1024**3, plan.device_tier_bytes / 1024**3,
        )
        return plan

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
        check_device(device)
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
        """Wrap an already loaded model and tokenizer (``settings``: fields of
        :class:`~kvboost_rag.config.KVBoostSettings`)."""
        return cls(model, tokenizer, KVBoostSettings(**settings))

    @property
    def features(self) -> ModelFeatures:
        """What the model supports, probed when the engine was built: batched decoding, and
        whether the attention repair can read its attention (else results report the
        CacheBlend fallback as their ``strategy``)."""
        return self._adapter.features

    @property
    def small_row_kernel(self) -> str:
        """The linear layers' kernel in decode and verify steps, chosen at load
        (``decode_weights``, ``small_row_kernels``): ``"int8"`` (an int8 copy of the weights),
        ``"packed"``, ``"onednn"`` or ``"off"`` (the model's own); the layers stored as 4-bit
        runs are apart (:attr:`four_bit_layers`)."""
        return self._adapter.small_rows.kernel

    @property
    def four_bit_layers(self) -> int:
        """Linear layers whose decode and verify steps read their weights as stored 4-bit runs
        (a GGUF file's 4-bit tensors; ``decode_weights``), whatever :attr:`small_row_kernel`
        says of the others."""
        return len(self._adapter.small_rows.four_bit)

    # ------------------------------------------------------------------ text
    @property
    def captured_steps_run(self) -> int | None:
        """Decode and draft-verify steps run as captured graphs so far (all requests together);
        ``None`` when every step runs eagerly (``captured_steps`` off, not wanted on this
        device, or not built: the log says why)."""
        return None if self._captured is None else self._captured.runs

    def wait_for_captured_steps(self, timeout: float | None = None) -> bool:
        """Wait until the captured steps (and passes) built in the background
        (``captured_build="background"``) are all built or given up (the log says why);
        whether they are within ``timeout`` seconds. Meanwhile requests are served: on the
        eager path until a step's first bucket is ready. True at once without captured steps.
        """
        steps = [s for s in (self._captured, self._captured_prefill, self._captured_probe) if s is not None]
        return all(s.wait_until_built(timeout) for s in steps)

    @property
    def context_window(self) -> int:
        """Largest number of positions the model accepts."""
        return self._adapter.context_window

    def token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens)."""
        return self._tokenizing.ids(text)

    def token_ids_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character spans of ``text`` tokenized alone (no special tokens)."""
        return self._tokenizing.ids_with_offsets(text)

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
        return self._chat.render(messages, add_generation_prompt, tools)

    @property
    def chat_template_renders_tools(self) -> bool:
        """Whether the chat template shows tools passed as ``tools=`` (checked once)."""
        return self._chat.renders_tools

    # ------------------------------------------------------------------ warming
    def warm(self, text: str) -> WarmResult:
        """Cache ``text`` as a shared beginning (system prompt); prompts starting with it hit exactly.

        Warmed beginnings are pinned: eviction leaves them alone while room allows. Warming a
        text already stored computes and writes nothing (it loads and pins). Unless
        ``warm_prefix`` is set, documents warmed afterwards are computed behind the most
        recently warmed text.
        """
        return self._warming.warm(text)

    @property
    def document_context(self) -> str:
        """The text documents are warmed behind: ``settings.warm_prefix``, else the most
        recent text passed to :meth:`warm`, else a short neutral lead-in."""
        return self._warming.document_context

    def warm_documents(self, texts: Iterable[str], show_progress: bool | None = None) -> list[WarmResult]:
        """Cache documents so they hit by content hash wherever they land in a prompt.

        Each is computed behind :attr:`document_context` and ``warm_context_documents`` other
        documents, stored in ``chunk_size`` pieces beside a record any process over the same
        disk folder or Redis finds. Documents already cached are registered without reading
        their K/V; one longer than the context window is warmed up to it
        (``WarmResult.skipped_tokens``). Warns when the corpus does not fit the tiers;
        ``WarmResult.kept_in`` names the tiers that hold each document's entries between them.

        Args:
            texts: Document texts, exactly as they will appear in prompts.
            show_progress: Progress bar (default: ``settings.show_progress``, and only for
                more than one document).

        Raises:
            InvalidInputError: ``texts`` is one string, or a document is empty or not text.
        """
        return self._warming.warm_documents(texts, show_progress)

    def is_document_warm(self, text: str) -> bool:
        """Whether every chunk of ``text`` is cached and its record is stored (stores and
        computes nothing)."""
        return self._warming.is_document_warm(text)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str, options: GenerationOptions | None = None, **overrides: Any) -> GenerationResult:
        """Generate a completion of ``prompt``, reusing cached K/V where possible.

        Concurrent calls (threads, async integrations) decode together in one batch.

        Args:
            prompt: The full prompt text.
            options: Decoding and reuse options (defaults when omitted).
            **overrides: Fields of :class:`~kvboost_rag.request.options.GenerationOptions`
                (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``reuse``,
                ``documents``, ``return_logits``, ``constraint``), applied over ``options``.

        Raises:
            InvalidInputError: Empty prompt, bad options (the message names the field), an
                invalid constraint, or a constraint without llguidance installed.
            PromptTooLongError: The prompt does not fit the context window.
            RequestCancelled: The call was cancelled (run by an async bridge whose task was
                cancelled, see :mod:`kvboost_rag.integration.async_stream`).
        """
        stream = self.stream(prompt, options, **overrides)
        for _ in stream:
            pass
        if stream.result is None:
            raise RequestCancelled("the call was cancelled before its answer was complete")
        return stream.result

    def stream(self, prompt: str, options: GenerationOptions | None = None, **overrides: Any) -> GenerationStream:
        """Like :meth:`generate`, yielding text pieces as they decode.

        Input is validated here, before iteration starts. ``stream.result`` holds the
        :class:`GenerationResult` once the iterator is exhausted.
        """
        start = time.perf_counter()
        return self._requests.stream(prompt, GenerationOptions.resolve(options, overrides), start)

    def generate_batch(
        self, prompts: Sequence[str], options: GenerationOptions | None = None, **overrides: Any
    ) -> list[GenerationResult | Exception]:
        """Generate completions of several prompts, decoding them together.

        Each prompt is prefilled with its own reuse, in order; a leading part several prompts
        share (at least ``chunk_size`` tokens) that no tier holds yet is computed once first.
        Then all decode together, one forward pass per step, each with its own stop strings,
        EOS and token budget. Greedy outputs equal those of :meth:`generate` on each prompt
        alone. At most ``max_batch_size`` prompts (and ``max_batch_cache_bytes`` of K/V)
        decode at once; concurrent calls share the same batch.

        Args:
            prompts: Full prompt texts.
            options: Options for every prompt (defaults when omitted).
            **overrides: Fields of :class:`~kvboost_rag.request.options.GenerationOptions`.

        Returns:
            One entry per prompt, in order: its :class:`GenerationResult` (``ttft_ms`` from
            this call to that prompt's first token), or the exception that failed that prompt
            alone (:class:`InvalidInputError`, :class:`PromptTooLongError`, or what ended its
            decoding).

        Raises:
            InvalidInputError: ``prompts`` is one string, or the shared options are bad.
        """
        start = time.perf_counter()
        return self._batches.generate_batch(prompts, GenerationOptions.resolve(options, overrides), start)

    def min_new_tokens(self, constraint: OutputConstraint | Mapping[str, Any]) -> int | None:
        """The smallest ``max_new_tokens`` a call constrained by ``constraint`` accepts (the
        tokens of the shortest valid output); a smaller budget is an :class:`InvalidInputError`
        naming it. ``None`` when the engine finds no way to close this constraint's outputs.

        Raises:
            InvalidInputError: An invalid constraint, or llguidance not installed.
        """
        resolved = GenerationOptions.resolve(None, {"constraint": constraint}).constraint
        assert resolved is not None
        return self._constraints.minimum_tokens(resolved)

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
        this engine started (reads key names only); returns the number now known."""
        return self._cache.index.attach_stored_documents()

    def cache_stats(self, flush_timeout: float | None = STATS_FLUSH_SECONDS) -> CacheStats:
        """Counters of the cache and its tiers, and every byte held for K/V
        (:attr:`CacheStats.memory`), once the cache writes queued so far are done.

        Args:
            flush_timeout: Seconds to wait for those writes at most (default
                :data:`~kvboost_rag.cache.manager.STATS_FLUSH_SECONDS`): past it the figures
                leave out the writes a slow tier has not taken yet, and a warning says how
                many. ``None``: wait for them all; ``0``: the figures as they stand.
        """
        pool = self._requests.memory.host_buffers
        held = KVMemory(
            batch_buffers_bytes=self._places.held_bytes,
            idle_buffers_bytes=0 if pool is None else pool.idle_bytes,
            decode_weights_bytes=self._adapter.small_rows.copy_bytes,
            limits={
                "max_batch_cache_bytes": self.settings.max_batch_cache_bytes,
                "packed_weights_bytes": self.settings.packed_weights_bytes,
            },
        )
        return self._cache.stats(held, flush_timeout)

    def clear_cache(self) -> None:
        """Drop every cached entry and registered document (after the cache writes queued
        so far)."""
        self._cache.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every cache write queued before this call has reached the tiers (memory,
        disk, Redis); writes queued meanwhile by other requests are not waited for.

        A call returns at its last token: what its prompt taught the cache is visible to every
        later request at once, and is copied into host memory and written to the tiers behind
        it. Flush before reading the tiers from outside this process or before shutting down
        (interpreter exit also lets the queued writes finish before it tears anything down).

        Args:
            timeout: Seconds to wait at most (``None``: no limit).

        Returns:
            Whether every queued write finished.
        """
        return self._cache.flush(timeout)
