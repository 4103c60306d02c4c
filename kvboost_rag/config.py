"""Validated engine settings.

All tuning knobs of the engine live in :class:`KVBoostSettings`, one pydantic model. A bad
value raises ``pydantic.ValidationError`` (a ``ValueError``) whose message names the field
and what it accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

RecomputeStrategy = Literal["attention", "cacheblend", "selective", "none"]
ProbeWeighting = Literal["attention", "value", "depth", "value_depth"]
#: Shortest accepted ``cache_secret_key`` (a short secret can be guessed offline from one entry).
MIN_SECRET_KEY_CHARS = 16
#: Largest token bucket of a captured step.
MAX_CAPTURED_TOKENS = 1024
#: Largest token bucket of a captured prefill pass.
MAX_CAPTURED_PREFILL_TOKENS = 8192
#: ``prefill_chunk_tokens="auto"`` per device type (other devices take the CUDA value).
AUTO_PREFILL_CHUNK_TOKENS = {"cpu": 512, "cuda": 2048}


class KVBoostSettings(BaseModel):
    """Settings of a :class:`~kvboost_rag.engine.KVBoost` engine.

    Attributes:
        recompute_strategy: How documents served from cache at new positions are repaired:
            ``"attention"`` recomputes the cached tokens the prompt's last token attends to
            most, read from one pass of the tokens computed anyway (question, separators)
            over the cache as loaded; ``"cacheblend"`` recomputes the tokens whose K/V deviate
            most at ``check_layer``; ``"selective"`` recomputes the first tokens of each
            document (just after each seam); ``"none"`` does no repair.
        recompute_ratio: Share of the document tokens served from cache that are recomputed
            (default 10%: at least 4x sooner than full prefill at median first-token KL under
            0.01 on the corpora measured in ``docs/benchmarks.md``; 15% lowers KL by about a
            third and costs 20-25% more time to the first token), or ``"auto"`` (attention and CacheBlend): per prompt, as many tokens as it takes
            to bring the last token's attention left on stale tokens under
            ``max_stale_attention`` (attention) or the relative K/V deviation left at
            ``check_layer`` under ``max_deviation`` (CacheBlend), between
            ``min_recompute_ratio`` and ``max_recompute_ratio``.
        max_deviation: Target of ``recompute_ratio="auto"`` with CacheBlend: mean relative K/V deviation
            (squared deviation over squared norm of the fresh K/V at ``check_layer``) left in
            the tokens that are not recomputed. The default recomputes about 10-20% of the
            document tokens of typical RAG prompts on SmolLM2-135M at ``check_layer=1`` with
            documents warmed behind one context document (the bench's left deviation at 15%:
            1.2e-4 on 2.1k-token plain prompts, 7e-5 on 3.7k-token chat prompts).
        max_stale_attention: Target of ``recompute_ratio="auto"`` with the attention strategy:
            share of the last token's attention (averaged over layers) that may stay on cached
            tokens that are not recomputed. SmolLM2-135M's last token puts about a third of its
            attention on the documents of RAG prompts; the default recomputed 15% of the
            document tokens of the bench's 2.1k-token plain prompts, 11% of its 3.7k-token chat
            prompts and 10% (the floor) of 5.5k-token chat prompts, at median first-token KL
            0.0035-0.0043.
        probe_layers: Decoder layers the attention strategy's probe runs (from the first);
            ``None``: every layer. Fewer layers make the probe cheaper and choose by the
            attention of the shallow layers only.
        probe_queries: How many of the last live tokens (the end of the question) the attention
            strategy reads the attention of, summed; ``1``: the prompt's last token only.
            Tokens the first decoded tokens will read are also read by the question's last
            tokens, not always by its very last one.
        probe_weighting: How the attention strategy scores cached tokens from the probe's
            attention, summed over layers: ``"attention"`` as recorded; ``"value"`` weighted by
            the norm of the token's cached value in that layer (what a token adds to the output
            is its weight times its value); ``"depth"`` weighted by the layer's depth (a cached
            token's first-layer K/V is exact, deeper ones drift more); ``"value_depth"`` both.
        lookahead_ratio: Attention strategy only: once the answer's first token is chosen
            (and on its way to the caller: the time to first token does not include this),
            that token runs once over the repaired cache and this share of the document tokens
            served from cache, the stale ones it attends to most, is recomputed before it is
            decoded, so the tokens after it read fresher K/V. ``0`` (default): none.
        min_recompute_ratio: Least share ``"auto"`` recomputes (CacheBlend 5% measured worse
            than no repair on 3 of 6 chat prompts, 10% on none).
        max_recompute_ratio: Largest share ``"auto"`` recomputes.
        chunk_size: Tokens per stored chunk. Prefixes are cut on a grid of this size from the
            prompt's start; each document is cut on a grid starting at its own first token.
        kv_cache_bits: Store K/V quantized to 8 or 4 bits; ``None`` keeps the model's dtype.
        kv_group_size: Quantization group size: tokens per key group (keys are quantized per
            channel), channels per value group (values are quantized per token).
        max_cache_bytes: Byte budget of the in-memory tier. Documents (record and K/V chunks)
            are evicted whole; prefix chunks no prompt reused go first, pinned beginnings last.
            The embedded model's float32 K/V takes about 46 KB a token, so 2 GiB holds about
            45k tokens (about 110 documents of 400 tokens).
        device_cache_bytes: Byte budget of the hot tier in GPU memory, above the memory tier,
            used when the model runs on CUDA (the memory tier then keeps entries in pinned
            memory, so copies to the GPU are asynchronous). ``"auto"`` (default): half the GPU
            memory free when the engine is built once a headroom for activations and the
            captured steps' pool are set aside
            (:func:`~kvboost_rag.cache.device_memory.plan_device_memory`), so the documents of
            long prompts stay on the GPU (the K/V of a 32k-token prompt of an 8B model is
            about 4 GiB). A number of bytes sets it; 0 disables it; ignored on CPU.
        disk_cache_dir: Folder of the disk tier. ``"auto"`` (default): an overflow tier in
            ``$KVBOOST_RAG_KV_CACHE``, else ``$KVBOOST_RAG_HOME/kv-cache`` (default
            ``~/.cache/kvboost-rag/kv-cache``), that receives only what the memory tier evicts,
            so a corpus larger than ``max_cache_bytes`` stays usable; ``KVBOOST_RAG_KV_CACHE=off``
            turns it off. A folder: a write-through tier (every entry is written; restarts and
            other processes find them). ``None``: no disk tier (documents evicted from memory
            are dropped whole and must be warmed again).
        max_disk_bytes: Byte budget of the disk tier (least recently used files of any model go
            first; shared by every process using the folder).
        redis_url: Shared Redis tier; ``None`` disables it. ``redis://host:port/db`` (also
            ``rediss://``, ``unix://``) names one server or any node of a Redis Cluster;
            ``redis+sentinel://host:port[,host:port]/service[/db]`` a master through Sentinel.
        redis_cluster: Whether ``redis_url`` names a Redis Cluster node; ``None`` (default):
            asked of the server on first use (``INFO cluster``). On a cluster, entries spread
            over the shards, the keys of one entry stay on one shard, and a lost shard's
            entries are misses while the others keep hitting (docs/scale.md).
        redis_ttl_seconds: Expiry of entries written to Redis; ``None`` leaves eviction to the
            server.
        cache_secret_key: Secret (at least 16 characters) that authenticates disk and Redis
            entries with HMAC-SHA256. Set it when other processes or users can write to the
            cache folder or the Redis server: entries without a valid MAC under this key
            (written without it, with another key, or crafted) are misses and are deleted.
            Every process sharing those tiers needs the same key. ``None``: entries carry a
            plain checksum (protects against damage, not against a writer).
        device: Torch device the model runs on (``"cpu"``, ``"cuda"``, ``"cuda:1"``...);
            ``None`` keeps the model where it is (``from_pretrained`` then picks CUDA when
            available).
        dtype: Weights dtype for ``from_pretrained`` (``"float32"``, ``"bfloat16"``,
            ``"float16"``); ``None`` picks float32 on CPU and bfloat16 on CUDA.
        warm_prefix: Text that documents are warmed behind (usually the system prompt), so
            their first tokens do not become attention sinks. ``None``: the most recent text
            passed to ``warm()``, or a short neutral lead-in before any. Documents warmed
            behind one text still hit under any other (the repair handles the difference).
        warm_context_documents: Other documents of the corpus placed between that text and
            each document being warmed, as in a RAG prompt where other retrieved documents come
            before it: the first distinct documents this engine warms (a document is never
            behind itself). A document read behind other documents has K/V much closer to the
            one it gets in real prompts than one read behind the system prompt alone (first-token
            KL with no repair fell from 0.073 to 0.021 on the plain benchmark prompts with one).
            ``0`` warms documents behind the text alone.
        check_layer: Layer whose K/V deviation picks the tokens CacheBlend recomputes. Layers
            up to and including it are computed for every token during selection (into
            scratch buffers: the cache keeps the cached K/V of the tokens not chosen).
        blend_stages: CacheBlend's gradual filtering: the chosen tokens run the layers in this
            many equal spans, and after each span only those whose K/V deviated most at its
            last layer go on (set sizes fall linearly, two stages: 1.5x then 0.5x the budget,
            so the compute equals ``recompute_ratio`` in every layer). ``1`` (default): the
            chosen tokens run every layer. Two stages lowered mean first-token KL on the
            bench's 2.1k-token plain prompts and raised it on its 3.7k-token chat prompts
            (SmolLM2-135M, documents warmed behind a context document).
        keep_document_start: Tokens at the start of each cached document that are always
            recomputed (they carried the attention sink when the document was warmed).
        strict: Raise instead of falling back to prefix-only reuse on models where
            position-independent reuse would be wrong.
        store_generated_documents: After a generate, store documents that were not cached yet
            so the next prompt hits without an explicit warm.
        store_prompt_blocks: Also store, as documents, the blocks of a prompt's text that no
            one named: pieces of at least 64 characters set off by blank lines, separator
            lines (``---``) or the chat template's special tokens, but the prompt's opening
            (the system prompt, an exact prefix) and its closing question (see
            :mod:`kvboost_rag.request.blocks`). Stuff-documents prompts join retrieved
            documents that way, so a plain prompt's documents are found in any order next time
            without ``documents=`` or a warm. A block seen for the first time does not end the
            prompt's stored prefix, so the same prompt asked again, or a conversation that
            continues it, still hits exactly. ``False``: only named and warmed documents are
            stored.
        show_progress: Show progress bars on long work (``warm_documents``).
        warm_batch_tokens: ``warm_documents`` hands the engine loop several documents at once,
            up to this many tokens (their K/V buffers are held together), and the loop packs
            their passes into shared forward passes; each document's stored K/V is the one a
            one-by-one warm computes. 0 hands them over one at a time.
        max_batch_size: Most requests decoded together: concurrent ``generate``/``stream``
            calls and the prompts of ``generate_batch`` share each decode step up to this
            many; later ones wait, first come first served, and join as places free up.
        max_batch_cache_bytes: Most bytes of K/V buffers (prompt plus room for its new
            tokens) the requests decoded together may hold; a request that would exceed it
            waits (one request is always admitted when none runs).
        prefill_chunk_tokens: Most prompt tokens one step of the engine loop carries (a
            prefill chunk, the repair's passes, documents being warmed): the budget of a step
            when no answer is decoding; a longer pass runs over several steps, giving what
            the whole pass gives to float tolerance. ``"auto"`` (default): 512 on a CPU,
            2048 on CUDA (there, the decode rows and the prompt tokens of a step together,
            as vLLM's ``max_num_batched_tokens``).
        max_decode_wait: How much longer than a decode-only step a step that also carries
            prompt work may take, in decode-only steps. Every step of the engine loop runs the
            open streams' next tokens together with a slice of waiting prompt work (a
            prefill, a repair pass, a warm) in one forward pass; on a CPU the slice is sized
            from the measured costs of recent steps so that such a step takes about
            ``1 + max_decode_wait`` decode-only steps: a stream's gap between two pieces while
            another request prefills. Lower favours the streams, higher the requests
            prefilling beside them (a prompt gets about ``max_decode_wait / (1 +
            max_decode_wait)`` of the machine's time while answers decode). The slice never
            drops below the smallest one measured to cost about what its tokens cost with no
            stream beside them, so however low the bound, concurrent requests finish sooner
            than one after another (the measured trade-off: docs/server.md).
        draft_tokens: Most tokens a decode step drafts from the prompt's documents, its other
            text and the answer so far, and verifies in the same forward pass (greedy output
            stays what plain decoding gives, whatever ``decode_weights``: a verify step computes
            each token as a one-token step would, bitwise but for the float32 rounding of layers
            that read float32 weights; sampling keeps its distribution). The length of
            each draft follows how often drafts were accepted and what a longer step costs on
            this machine, measured as it decodes; no draft where nothing matches. ``0`` turns
            drafting off.
        decode_weights: What the linear layers of decode and verify steps read (on a CPU a
            step is bound by the bytes it reads: every weight once, whatever its few rows):
            ``"model"`` (the model's own float32 weights, through ``small_row_kernels``),
            ``"int8"`` (an int8 copy with one scale per output channel, made at load, through
            FBGEMM's dynamic quantized linear with each row's activations rounded to 8 bits, or
            torch's weight-only ``_weight_int8pack_mm`` where a torch build has no FBGEMM: a
            quarter of the bytes, greedy answers no longer exactly the model's own; the copy
            costs a quarter of the float32 weights, not the whole again as the packed copy
            does), ``"stored"`` (the layers whose float32 weights are 4-bit runs, a GGUF file's
            Q4_0, Q4_1 or Q4_K tensors as ``convert_gguf`` and the embedded model hold them, are
            read as stored, 4 bits per weight, through torch's CPU 4-bit kernel with bfloat16
            activations: an eighth of the float32 bytes, the values the model's own up to the
            bfloat16 rounding of each run's step and offset; the other layers as ``"model"``),
            or ``"auto"`` (default: ``"int8"`` only for the models whose int8 answers were
            measured to equal their own, see docs/benchmarks.md, with their 4-bit runs as
            ``"stored"``; else ``"model"``). On rounded activations (int8, 4-bit runs) the
            float32 rounding differences between reuse paths grow to logit differences of up to
            ~0.1 in the decode steps after the first token, enough to change an answer after a
            near tie. So where decode rounds activations, a prompt without documents runs its
            last token in a pass of its own, as the same prompt asked again (read from cache but
            for that token) does: the second answer is bitwise the first (measured on
            Qwen2.5-Coder-0.5B's int8 default: 5 of 8 chat prompts answered differently within
            64 tokens before, 0 of 8 after), for one more read of the float32 weights in the
            first call (its first token 1.30x later after a prefix hit with a 20-token
            question). Other pairs of paths (prefix hits of other lengths, the repair) can still
            part after a near tie, which is why ``"stored"`` is not the embedded model's
            default; ``"model"`` gives answers that do not depend on what the cache held.
            A model quantized through torchao (transformers' ``TorchAoConfig`` with
            ``Int8WeightOnlyConfig`` or ``Int8DynamicActivationInt8WeightConfig``) has no
            float32 weights: where decode reads int8 its int8 layers are read from their stored
            values and scales (no requantization; kvboost_rag/decode_weights/stored_int8.py), else through
            their own ``forward`` (torchao's, which widens the values to float32 every call).
            Where the int8 kernel does not apply (CUDA,
            16-bit or other quantized weights, a CPU without AVX2) decode reads the model's own.
            Prompt work (prefill, the tokens after a prefix hit, the repair's passes, warming),
            even in a step beside decode rows, and calls of the model outside the engine, always
            read the model's own weights, so the first token of every reuse path is unchanged. Not used with captured steps.
        small_row_kernels: The kernel of the linear layers (projections, MLPs, logits) over the
            model's own float32 weights in decode and verify steps, chosen when the engine
            loads (:mod:`kvboost_rag.decode_weights.small_rows`): on a CPU, torch's float32 product of 2-16
            rows costs 2-5x one row, while oneDNN over weights reordered once into its blocked
            layout costs about one row's whatever the rows. ``"auto"`` (default) decides by a
            rule, the same on every start: ``"packed"`` where oneDNN applies, the layers'
            weights are 64 MiB or more and the copy fits ``packed_weights_bytes``, else
            ``"off"`` (on CUDA, 16-bit or quantized weights, or without oneDNN: ``F.linear``);
            ``"packed"`` (oneDNN over a copy of the weights, within ``packed_weights_bytes``),
            ``"onednn"`` (oneDNN over the model's own weights), or ``"off"``. On Intel CPUs the
            oneDNN kernels take steps of 3 rows or more; steps of 1-2 rows keep ``F.linear``,
            which reads the weights at the memory's speed there. Prefill passes,
            and calls of the model outside the engine, always run the model's own
            ``F.linear``. Not used with captured steps, nor when decode reads int8.
        packed_weights_bytes: Most bytes the packed weight copies of ``small_row_kernels``
            may take (they cost the float32 weights' bytes again: a 0.5B model, 2 GB);
            beyond it, ``"packed"`` is not chosen.
        captured_steps: Whether decode and draft-verify steps run as compiled graphs over a
            static K/V pool (:mod:`kvboost_rag.hf.captured`; on CUDA each step is one CUDA
            graph launch instead of a launch per kernel): ``"auto"`` (default) on CUDA only,
            ``"on"``, ``"off"``. On a CPU ``"on"`` is a choice for long-running processes: the
            first load compiles for minutes (the embedded model's five buckets: 636 s on 2
            cores, 62 s from the on-disk cache), and captured steps read the model's float32
            weights, so they decode faster than eager steps over those weights (the embedded
            model without drafts 1.2-1.4x, docs/benchmarks.md) but not than eager steps over the
            int8 copies ``decode_weights`` makes (a warning says when those go unused). The
            graphs are built when the engine loads (compiled once per token bucket, see
            ``captured_build``; later processes take them
            from torch's on-disk compile cache). A sequence that finds no free slot, or a model
            whose steps cannot be captured, decodes on the eager path. Read by
            :func:`kvboost_rag.hf.captured.build_captured_rows` when the engine loads.
        captured_pool_bytes: Bytes of the static K/V pool of captured steps (K and V of every
            slot; slots of capacities from 1,024 tokens doubling up to the model's context
            window, largest first, while the budget lasts). ``"auto"``: on CUDA sized with the
            device tier from the GPU memory free after the model loaded
            (:func:`~kvboost_rag.cache.device_memory.plan_device_memory`: up to one slot of
            every capacity from the context window down, within 40% of what a headroom for
            activations leaves), so long prompts decode captured too; elsewhere
            ``max_batch_cache_bytes``.
        captured_token_buckets: Token counts captured steps are built for (powers of two, one
            graph each): a step of several rows runs their tokens end to end, padded to the
            smallest bucket that holds them (one token per row for decoding, ``1 + drafts`` for
            draft-verify). More buckets cost more compile time at load.
        captured_prefill_buckets: Token counts of captured prefill passes (powers of two up to
            8,192; empty, the default: prefill passes run eagerly). With captured steps on, a
            prompt's pass over its slot (the tokens after an exact prefix hit; the attention
            repair's probe, which also records the attention of its last ``probe_queries``
            tokens; the blend pass of a document repair: its chosen and live tokens at their
            positions) runs as one compiled graph, one CUDA graph on CUDA, when its tokens fit
            the largest bucket,
            padded to the smallest that holds them; longer passes, and prompts without a slot,
            run eagerly. One graph per bucket is built when the engine loads. Tested on CPU
            against the eager passes, not yet timed on a GPU, so not on by default; such as
            ``(64, 256, 1024, 4096)``.
        captured_build: When the captured steps' graphs are built: ``"background"`` (default)
            on a thread of their own as the engine loads, smallest bucket first (decode steps,
            then prefill passes), each used as soon as it is ready while requests are served on
            the eager path meanwhile (the log says which are ready;
            :meth:`~kvboost_rag.KVBoost.wait_for_captured_steps` waits for all); ``"at_load"``:
            all of them before the engine's constructor returns. Compiled code is kept in
            torch's on-disk caches under the engine's cache folder
            (:func:`~kvboost_rag.default_model.cache_home`), so a later process builds them
            in seconds.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    recompute_strategy: RecomputeStrategy = "attention"
    recompute_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = 0.10
    max_deviation: float = Field(1e-4, gt=0.0, le=1.0)
    max_stale_attention: float = Field(0.08, gt=0.0, le=1.0)
    probe_layers: int | None = Field(None, ge=1)
    probe_queries: int = Field(1, ge=1, le=256)
    probe_weighting: ProbeWeighting = "attention"
    lookahead_ratio: float = Field(0.0, ge=0.0, le=1.0)
    min_recompute_ratio: float = Field(0.10, ge=0.0, le=1.0)
    max_recompute_ratio: float = Field(0.5, ge=0.0, le=1.0)
    chunk_size: int = Field(128, ge=8, le=8192)
    kv_cache_bits: Literal[4, 8] | None = None
    kv_group_size: int = Field(32, ge=8, le=1024)
    max_cache_bytes: int = Field(2 * 1024**3, gt=0)
    device_cache_bytes: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    disk_cache_dir: Literal["auto"] | Path | None = "auto"
    max_disk_bytes: int = Field(20 * 1024**3, gt=0)
    redis_url: str | None = None
    redis_cluster: bool | None = None
    redis_ttl_seconds: int | None = Field(None, gt=0)
    cache_secret_key: SecretStr | None = None
    device: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    warm_prefix: str | None = None
    warm_context_documents: int = Field(1, ge=0, le=8)
    check_layer: int = Field(1, ge=0)
    blend_stages: int = Field(1, ge=1, le=8)
    keep_document_start: int = Field(0, ge=0)
    strict: bool = False
    store_generated_documents: bool = True
    store_prompt_blocks: bool = True
    show_progress: bool = True
    warm_batch_tokens: int = Field(4096, ge=0)
    max_batch_size: int = Field(16, ge=1, le=1024)
    max_batch_cache_bytes: int = Field(2 * 1024**3, gt=0)
    prefill_chunk_tokens: Annotated[int, Field(ge=16, le=1 << 20)] | Literal["auto"] = "auto"
    max_decode_wait: float = Field(0.7, ge=0.0, le=64.0)
    draft_tokens: int = Field(15, ge=0, le=15)
    decode_weights: Literal["auto", "model", "int8", "stored"] = "auto"
    small_row_kernels: Literal["auto", "packed", "onednn", "off"] = "auto"
    packed_weights_bytes: int = Field(4 * 1024**3, ge=0)
    captured_steps: Literal["auto", "on", "off"] = "auto"
    captured_pool_bytes: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    captured_token_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    captured_prefill_buckets: tuple[int, ...] = ()
    captured_build: Literal["background", "at_load"] = "background"

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str | None) -> str | None:
        if value is None:
            return value
        kind = value.split(":", 1)[0]
        if kind not in {"cpu", "cuda", "mps", "xpu"}:
            raise ValueError(f"device must be 'cpu', 'cuda[:N]', 'mps' or 'xpu', got {value!r}")
        return value

    def prefill_chunk_for(self, device_type: str) -> int:
        """Tokens per prefill chunk on a device of this type (``"cpu"``, ``"cuda"``, ...):
        ``prefill_chunk_tokens``, or its ``"auto"`` value for the device."""
        if self.prefill_chunk_tokens != "auto":
            return self.prefill_chunk_tokens
        return AUTO_PREFILL_CHUNK_TOKENS.get(device_type, AUTO_PREFILL_CHUNK_TOKENS["cuda"])

    @field_validator("captured_token_buckets", "captured_prefill_buckets")
    @classmethod
    def _power_of_two_buckets(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        decode = info.field_name == "captured_token_buckets"
        largest = MAX_CAPTURED_TOKENS if decode else MAX_CAPTURED_PREFILL_TOKENS
        if (decode and not value) or any(b < 1 or b > largest or b & (b - 1) for b in value):
            example = "(1, 2, 4, 8, 16)" if decode else "(64, 256, 1024, 4096), or empty (eager prefill passes)"
            raise ValueError(f"{info.field_name} must be powers of two from 1 to {largest}, such as {example}; got {value}")
        return tuple(sorted(set(value)))

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        schemes = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
        if value is not None and not value.startswith(schemes):
            raise ValueError(
                f"redis_url must start with redis://, rediss://, unix:// or redis+sentinel://, got {value!r}"
            )
        return value

    @field_validator("cache_secret_key")
    @classmethod
    def _long_enough_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_SECRET_KEY_CHARS:
            raise ValueError(f"cache_secret_key must have at least {MIN_SECRET_KEY_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _auto_needs_a_measure(self) -> KVBoostSettings:
        if self.recompute_ratio == "auto" and self.recompute_strategy not in ("attention", "cacheblend"):
            raise ValueError(
                f"recompute_ratio='auto' needs recompute_strategy='attention' or 'cacheblend' (it reads "
                f"their attention or deviation), got {self.recompute_strategy!r}: set a number instead"
            )
        if self.min_recompute_ratio > self.max_recompute_ratio:
            raise ValueError("min_recompute_ratio must not exceed max_recompute_ratio")
        return self

    @model_validator(mode="after")
    def _group_fits_chunk(self) -> KVBoostSettings:
        if self.kv_cache_bits is not None and self.kv_group_size > self.chunk_size:
            raise ValueError(
                f"kv_group_size ({self.kv_group_size}) must not exceed chunk_size ({self.chunk_size})"
            )
        return self
