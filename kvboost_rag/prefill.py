"""Prefill with reuse: exact prefix hits, re-rotated document hits, CacheBlend repair.

For one tokenized prompt, :class:`Prefiller` decides which tokens come from cache and which
are computed, runs the model once over the computed ones, and returns the last position's
logits plus a cache ready for decoding.

- Only prefix hits (or nothing cached): the prefix K/V goes into a dynamic cache and the rest
  of the prompt is prefilled on top of it. Same logits as full prefill.
- Document hits: their K/V is re-rotated to the new positions and stitched with the prefix
  into full-length tensors. CacheBlend runs the non-prefix tokens through the first
  ``check_layer + 1`` layers only (those layers become exact for every token), picks the
  cached tokens whose K/V deviates most at ``check_layer``, then runs only those plus the
  live tokens through all layers, scattering their K/V into the stitched cache with
  attention made causal by position. No pass over all cached tokens through the whole model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvboost_rag.blend import (
    kv_deviation,
    leading_tokens,
    recompute_budget,
    select_by_deviation,
    select_document_starts,
)
from kvboost_rag.cache_manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.kv_codec import KVBlock
from kvboost_rag.model_adapter import ModelAdapter
from kvboost_rag.segments import DocumentOccurrence, DocumentRecord, align_tokens

logger = logging.getLogger(__name__)


@dataclass
class TokenizedPrompt:
    """A prompt as full prefill sees it."""

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]


@dataclass
class ContentHit:
    """Cached document rows placed at new prompt positions."""

    block: KVBlock
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


@dataclass
class PrefillOutcome:
    """Logits of the last prompt token, the cache to decode from, and what was reused."""

    logits: torch.Tensor
    cache: DynamicCache
    prefix_tokens: int = 0
    content_tokens: int = 0
    recomputed_tokens: int = 0
    live_tokens: int = 0
    merged_tokens: int = 0
    occurrences: list[DocumentOccurrence] = field(default_factory=list)
    exact_until: int = 0
    strategy: str = "full"


class Prefiller:
    """Runs prefill with whatever the cache can serve.

    Args:
        adapter: The model adapter.
        cache: The cache manager.
        settings: Engine settings.
    """

    def __init__(self, adapter: ModelAdapter, cache: CacheManager, settings: KVBoostSettings) -> None:
        self.adapter = adapter
        self.cache = cache
        self.settings = settings

    def full(self, prompt: TokenizedPrompt, extra: int) -> PrefillOutcome:
        """Plain prefill of every token (the baseline); ``extra`` tokens of room for decoding."""
        n = len(prompt.ids)
        kv = self.adapter.new_cache(n + extra)
        logits = self.adapter.forward(torch.tensor(prompt.ids), torch.arange(n), kv)
        return PrefillOutcome(logits=logits, cache=kv, live_tokens=n, exact_until=n, strategy="full")

    def with_reuse(
        self, prompt: TokenizedPrompt, documents: list[DocumentRecord], allow_content: bool, extra: int
    ) -> PrefillOutcome:
        """Prefill reusing cached prefix chunks and (if allowed) cached documents.

        Args:
            prompt: The tokenized prompt.
            documents: Documents the caller says are in the prompt.
            allow_content: Whether document K/V may be moved to new positions.
            extra: Tokens of room to reserve in the cache for decoding.
        """
        n = len(prompt.ids)
        pieces = self.cache.match_prefix(prompt.ids, limit=n - 1)
        h = sum(p.length for p in pieces)
        occurrences: list[DocumentOccurrence] = []
        hits: dict[str, ContentHit] = {}
        if allow_content:
            char_start = prompt.offsets[h - 1][1] if h else 0
            occurrences = self.cache.registry.find(prompt.text, documents, start=char_start)
            hits = self._content_hits(prompt, occurrences, h)
        merged = sum(o.merged_tokens for o in occurrences)
        keys, values = self.adapter.buffers(n + extra)
        for piece in pieces:
            end = piece.start + piece.length
            keys[:, :, piece.start : end] = piece.block.keys[:, :, : piece.length]
            values[:, :, piece.start : end] = piece.block.values[:, :, : piece.length]
        if not hits:
            outcome = self._exact(prompt, keys, values, h)
        else:
            outcome = self._blend(prompt, keys, values, h, hits)
        outcome.occurrences = occurrences
        outcome.merged_tokens = merged
        return outcome

    # ------------------------------------------------------------------ exact path
    def _exact(self, prompt: TokenizedPrompt, keys: torch.Tensor, values: torch.Tensor, h: int) -> PrefillOutcome:
        """Prefill the tokens after the prefix hit on top of it (same logits as full prefill)."""
        n = len(prompt.ids)
        kv = self.adapter.cache_over(keys, values, h)
        # On top of a cache, transformers hands SDPA an explicit mask and it takes a slow path
        # (measured 35% slower per token than prefill from scratch on CPU); causal attention
        # by position over blocks of queries keeps the prefix hit cheaper than full prefill.
        logits = self.adapter.forward(torch.tensor(prompt.ids[h:]), torch.arange(h, n), kv, sparse_queries=h > 0)
        return PrefillOutcome(
            logits=logits, cache=kv, prefix_tokens=h, live_tokens=n - h, exact_until=n, strategy="exact" if h else "full"
        )

    # ------------------------------------------------------------------ document hits
    def _content_hits(self, prompt: TokenizedPrompt, occurrences: list[DocumentOccurrence], h: int) -> dict[str, ContentHit]:
        token_at_char: dict[int, int] = {}
        for j in range(h, len(prompt.ids)):
            start, end = prompt.offsets[j]
            if end > start:
                token_at_char.setdefault(start, j)
        hits: dict[str, ContentHit] = {}
        missing: set[str] = set()
        last = len(prompt.ids) - 1
        for occ in occurrences:
            align_tokens(occ, prompt.ids, token_at_char, prompt.offsets)
            record = occ.record
            for j, k in occ.aligned:
                if j < h or j == last:
                    continue
                key = record.chunk_keys[record.chunk_of(k)]
                if key in missing:
                    continue
                hit = hits.get(key)
                if hit is None:
                    block = self.cache.load(key)
                    if block is None:
                        missing.add(key)
                        continue
                    hit = hits[key] = ContentHit(block)
                row = k - record.chunk_of(k) * record.chunk_size
                if row >= hit.block.num_tokens or int(hit.block.token_ids[row]) != prompt.ids[j]:
                    continue
                hit.rows.append(row)
                hit.positions.append(j)
        return {key: hit for key, hit in hits.items() if hit.positions}

    def _blend(
        self,
        prompt: TokenizedPrompt,
        keys: torch.Tensor,
        values: torch.Tensor,
        h: int,
        hits: dict[str, ContentHit],
    ) -> PrefillOutcome:
        """Stitch re-rotated document K/V after the prefix, repair, prefill the rest.

        ``keys``/``values`` are ``[layers, heads, capacity, dim]`` buffers holding the prefix;
        every other prompt position is written here or by the model call (cached rows below,
        computed rows by the scatter), so the buffers need no zero-filling.
        """
        adapter = self.adapter
        n = len(prompt.ids)
        cached = torch.zeros(n, dtype=torch.bool)
        for hit in hits.values():
            for row, position, length in _spans(hit.rows, hit.positions):
                delta = position - (hit.block.start_position + row)
                source = slice(row, row + length)
                target = slice(position, position + length)
                adapter.rotate_keys(hit.block.keys[:, :, source], delta, out=keys[:, :, target])
                values[:, :, target] = hit.block.values[:, :, source]
                cached[target] = True
        content_positions = cached.nonzero().view(-1)
        budget = recompute_budget(int(content_positions.numel()), self.settings.recompute_ratio)
        strategy = self.settings.recompute_strategy
        if strategy == "cacheblend":
            recompute = self._select_cacheblend(prompt, h, keys, values, content_positions, budget)
        elif strategy == "selective":
            recompute = select_document_starts(_runs(content_positions), budget)
        else:
            recompute = content_positions[:0]
        keep = leading_tokens(_runs(content_positions), self.settings.keep_document_start)
        compute = ~cached
        compute[:h] = False
        compute[recompute] = True
        compute[keep] = True
        compute[n - 1] = True
        positions = compute.nonzero().view(-1)

        stitched = adapter.cache_over(keys, values, n)
        stitched.arm(positions.to(adapter.device))
        logits = adapter.forward(torch.tensor(prompt.ids)[positions], positions, stitched, sparse_queries=True)
        first_content = int(content_positions[0]) if content_positions.numel() else n
        recomputed = int((cached & compute).sum())
        return PrefillOutcome(
            logits=logits,
            cache=stitched,
            prefix_tokens=h,
            content_tokens=int(content_positions.numel()),
            recomputed_tokens=recomputed,
            live_tokens=int(compute.sum()) - recomputed,
            exact_until=first_content,
            strategy=strategy,
        )

    def _select_cacheblend(
        self,
        prompt: TokenizedPrompt,
        h: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        content_positions: torch.Tensor,
        budget: int,
    ) -> torch.Tensor:
        """Recompute layers ``<= check_layer`` for every token after the prefix, in place in
        ``keys``/``values`` (those layers become exact), and return the ``budget`` cached
        tokens whose K/V deviated most at ``check_layer``."""
        adapter = self.adapter
        n = len(prompt.ids)
        check = min(self.settings.check_layer, adapter.num_layers - 1)
        cached_k = keys[check][:, content_positions].clone()
        cached_v = values[check][:, content_positions].clone()
        # A cache over the first check+1 layers of the same buffers: the partial pass appends
        # the fresh K/V of positions h..n-1 right where the stitched rows were.
        partial = adapter.cache_over(keys[: check + 1], values[: check + 1], h)
        adapter.forward_until_layer(torch.tensor(prompt.ids[h:]), torch.arange(h, n), partial, check)
        if budget == 0:
            return content_positions[:0]
        deviation = kv_deviation(keys[check][:, content_positions], values[check][:, content_positions], cached_k, cached_v)
        return select_by_deviation(content_positions, deviation.cpu(), budget)


def _spans(rows: list[int], positions: list[int]) -> list[tuple[int, int, int]]:
    """Group row->position pairs into ``(first_row, first_position, length)`` runs where both
    advance by one (one re-rotation angle per run)."""
    spans: list[tuple[int, int, int]] = []
    for row, position in zip(rows, positions):
        if spans:
            r0, p0, length = spans[-1]
            if row == r0 + length and position == p0 + length:
                spans[-1] = (r0, p0, length + 1)
                continue
        spans.append((row, position, 1))
    return spans


def _runs(positions: torch.Tensor) -> list[torch.Tensor]:
    """Split sorted positions into contiguous runs."""
    if positions.numel() == 0:
        return []
    breaks = (positions[1:] != positions[:-1] + 1).nonzero().view(-1) + 1
    return list(torch.tensor_split(positions, breaks.tolist()))
