"""Result objects returned by the engine (pydantic models)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class WarmResult(BaseModel):
    """What ``warm`` / ``warm_documents`` did for one text.

    Attributes:
        kind: ``"prefix"`` for a shared beginning, ``"document"`` for a document.
        num_tokens: Tokens in the text.
        new_tokens: Tokens whose K/V was computed by this call.
        cached_tokens: Tokens whose K/V was already stored.
        skipped_tokens: Tokens of a document beyond the context window, not warmed.
        already_warm: Nothing had to be computed.
        elapsed_ms: Wall time of the call for this text.
        prefix_hash: Key of the last prefix chunk (prefix kind).
        content_hash: Key of the document's first chunk (document kind).
        kept_in: Where the document's record and chunks were when the call returned: the
            tiers (fastest first: ``"device"``, ``"memory"``, ``"disk"``, ``"redis"``) holding
            them between them (a document partly spilled to disk is ``["memory", "disk"]``);
            empty when an entry was evicted during the call with no lower tier to keep it.
    """

    kind: Literal["prefix", "document"]
    num_tokens: int
    new_tokens: int
    cached_tokens: int
    skipped_tokens: int = 0
    already_warm: bool
    elapsed_ms: float
    prefix_hash: str | None = None
    content_hash: str | None = None
    kept_in: list[str] = Field(default_factory=list)


class GenerationResult(BaseModel):
    """One generation with its timing and reuse figures.

    Attributes:
        output_text: Decoded new text, cut before the first stop string.
        token_ids: Generated token ids (after the stop cut).
        generated_tokens: Number of generated tokens.
        drafted_tokens: Generated tokens that were drafted from the prompt's texts or the
            answer so far and accepted: each came out of a forward pass that also produced
            another token (only accepted drafts count).
        draft_steps: Decode steps that carried a draft (``drafted_tokens / draft_steps`` is
            the tokens accepted per verify step).
        decode_steps: Forward passes after the first token (a plain step produces one token, a
            verify step one plus the drafted tokens it accepted).
        finish_reason: ``"stop"`` (stop string), ``"eos"`` or ``"length"``.
        ttft_ms: Wall time from the call to the first token: tokenizing, lookup, loading,
            stitching, re-rotation, repair and prefill included (and, in a batch or under
            concurrent calls, the wait for a place and the prefills before this one).
        total_ms: Wall time of the whole call (in ``generate_batch``: from the call to this
            prompt's last token).
        prompt_tokens: Tokens in the prompt.
        cached_tokens: Prompt tokens whose K/V was loaded from cache and used as loaded: prefix
            hits plus content hits, less the tokens the repair recomputed in this call.
        prefix_hit_tokens: Tokens served exactly by prefix hash.
        content_hit_tokens: Document tokens served by content hash (re-rotated).
        recomputed_tokens: Content-hit tokens recomputed by the repair (with
            ``blend_stages > 1``, the mean per layer).
        recompute_ratio: ``recomputed_tokens / content_hit_tokens``: the repair budget used
            (with ``recompute_ratio="auto"``, chosen for this prompt).
        live_tokens: Prompt tokens computed because nothing was cached for them.
        boundary_merged_tokens: Document tokens that the tokenizer merged across a document
            boundary in this prompt (computed live).
        documents_found: Document occurrences located in the prompt (warmed, named, or stored
            from an earlier prompt; not the blocks of this prompt seen for the first time).
        kv_reuse_ratio: ``cached_tokens / prompt_tokens``.
        loaded_kv_bytes: Bytes of K/V copied from the cache's entries into this call's buffers
            (the prefix hit's rows and the documents' rows; a row is copied once, the
            entries stay where they are).
        strategy: Repair strategy used (``"exact"`` when only prefix hits were used).
        first_token_logits: Logits of the first generated position (``return_logits=True``).
        step_logits: Logits of every decoding step, ``[steps, vocab]``, the model's own
            (before any penalty or output constraint), one row per token chosen (a step
            that chose EOS included; ``return_logits=True``). With an output constraint that
            forces given tokens, this is the model read teacher-forced along them.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    output_text: str
    token_ids: list[int] = Field(default_factory=list)
    generated_tokens: int = 0
    drafted_tokens: int = 0
    draft_steps: int = 0
    decode_steps: int = 0
    finish_reason: Literal["stop", "eos", "length"] = "length"
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefix_hit_tokens: int = 0
    content_hit_tokens: int = 0
    recomputed_tokens: int = 0
    recompute_ratio: float = 0.0
    live_tokens: int = 0
    boundary_merged_tokens: int = 0
    documents_found: int = 0
    kv_reuse_ratio: float = 0.0
    loaded_kv_bytes: int = 0
    strategy: str = "full"
    first_token_logits: torch.Tensor | None = None
    step_logits: torch.Tensor | None = None


class PromptCheck(BaseModel):
    """Reuse path against full prefill for one prompt."""

    prompt_tokens: int
    kv_reuse_ratio: float
    first_token_kl: float
    top1_agrees: bool
    max_logit_diff: float
    outputs_identical: bool
    reuse_ttft_ms: float
    full_ttft_ms: float


class CorrectnessReport(BaseModel):
    """What ``verify_correctness`` measured over a set of prompts.

    Attributes:
        checks: One entry per prompt.
        mean_first_token_kl: Mean KL(full || reuse) of the first-token distributions.
        top1_agreement: Share of prompts whose first greedy token agrees.
        output_agreement: Share of prompts whose greedy outputs are identical.
        passed: ``top1_agreement == 1`` and mean KL within ``kl_tolerance``.
        kl_tolerance: Threshold used for ``passed``.
    """

    checks: list[PromptCheck]
    mean_first_token_kl: float
    top1_agreement: float
    output_agreement: float
    passed: bool
    kl_tolerance: float


class KVMemory(BaseModel):
    """Every byte the engine holds for K/V (and for the weight copies its decode steps read),
    by holder, beside the settings that bound them.

    Attributes:
        batch_buffers_bytes: K/V buffers of requests: running ones, and finished ones that have
            not handed them to the write-back yet (within ``max_batch_cache_bytes``, or one
            request when it alone runs).
        idle_buffers_bytes: Buffers of finished requests kept for the next ones (a model on a
            CPU; within a quarter of ``max_batch_cache_bytes`` and what the lent ones leave).
        copy_queue_bytes: The buffers (whole) of write-backs waiting for their host copies;
            device copies on CUDA.
        write_queue_bytes: Host copies on their way to the tiers.
        staged_entries: Entries staged now: lookups find them before the tiers hold them.
        staged_bytes: Their bytes (views of lent buffers count their rows).
        arena_bytes: Host memory of the write-back's arena (the memory tier's entries are
            carved from it); ``arena_used_bytes`` of it is taken.
        arena_used_bytes: Bytes of the arena's ranges held now.
        memory_tier_bytes: The memory tier's entries and the indexes (``max_cache_bytes``).
        device_tier_bytes: The device tier's entries (``device_cache_bytes``).
        decode_weights_bytes: Copies of the model's weights the decode steps read (the int8
            copy of ``decode_weights``, or the packed copy of ``small_row_kernels``; 0 when
            they read the model's own).
        limits: The settings that bound these, by name, in bytes.
    """

    batch_buffers_bytes: int = 0
    idle_buffers_bytes: int = 0
    copy_queue_bytes: int = 0
    write_queue_bytes: int = 0
    staged_entries: int = 0
    staged_bytes: int = 0
    arena_bytes: int = 0
    arena_used_bytes: int = 0
    memory_tier_bytes: int = 0
    device_tier_bytes: int = 0
    decode_weights_bytes: int = 0
    limits: dict[str, int] = Field(default_factory=dict)


class CacheStats(BaseModel):
    """Counters of the cache.

    Attributes:
        entries: Entries in the memory tier (K/V chunks and document records).
        memory_bytes: Bytes held by the memory tier, the indexes' bytes included
            (all within ``max_cache_bytes``).
        index_bytes: Estimated bytes of the in-process indexes (document anchors, prefix
            index).
        prefix_index_entries: Stored prefix chunks in the prefix index.
        documents: Documents kept: the engine can find them in prompts (their records and
            chunks are stored in some tier).
        documents_evicted: Documents dropped whole since the engine started because no tier
            could keep them (or one of their entries was corrupt).
        documents_by_tier: Document records each tier holds.
        tiers: Per-tier hits, evictions and bytes.
        misses: Lookups no tier could answer.
        counters: Engine counters (prefix/content hit tokens, boundary merges, ...).
        shared_bytes_written: Bytes written to the tiers other processes read: what Redis
            counts, plus the usage of a write-through disk folder (exact for one writer).
        memory: Every byte held for K/V, by holder (:class:`KVMemory`).
    """

    entries: int
    memory_bytes: int
    index_bytes: int = 0
    prefix_index_entries: int = 0
    documents: int
    documents_evicted: int = 0
    documents_by_tier: dict[str, int] = Field(default_factory=dict)
    tiers: dict[str, dict[str, int]]
    misses: int
    counters: dict[str, int]
    shared_bytes_written: int = 0
    memory: KVMemory = Field(default_factory=KVMemory)
