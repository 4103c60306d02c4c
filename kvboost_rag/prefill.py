"""Prefill of a planned prompt: exact prefix hits, re-rotated document hits, CacheBlend repair.

:meth:`Prefiller.run` reads a :class:`~kvboost_rag.plan.PromptPlan`, loads what the cache
holds, runs the model once over the tokens that must be computed, and returns a
:class:`~kvboost_rag.outcome.PrefillOutcome` (last logits, a cache ready for decoding, and
what was reused). It stores nothing: write-back reads the outcome.

- Only prefix hits (or nothing cached): the prefix K/V goes into the buffers and the rest of
  the prompt is prefilled on top of it. Same logits as full prefill.
- Document hits: their K/V is re-rotated to the new positions and stitched with the prefix
  into full-length buffers. CacheBlend runs the non-prefix tokens through the first
  ``check_layer + 1`` layers only, picks the cached tokens whose K/V deviates most at
  ``check_layer``, then runs only those plus the live tokens through all layers, scattering
  their K/V into the stitched cache with attention made causal by position. No pass over all
  cached tokens through the whole model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

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
from kvboost_rag.outcome import PrefillOutcome
from kvboost_rag.plan import PlacedDocument, PromptPlan

logger = logging.getLogger(__name__)


@dataclass
class ContentHit:
    """Cached document rows placed at new prompt positions."""

    block: KVBlock
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


class Prefiller:
    """Runs prefill with whatever the cache can serve.

    Args:
        adapter: The model adapter.
        cache: The cache manager (lookups only; storing is the write-back's job).
        settings: Engine settings.
    """

    def __init__(self, adapter: ModelAdapter, cache: CacheManager, settings: KVBoostSettings) -> None:
        self.adapter = adapter
        self.cache = cache
        self.settings = settings

    def run(self, plan: PromptPlan, *, reuse: bool = True) -> PrefillOutcome:
        """Prefill the planned prompt: look up, stitch, re-rotate, repair, compute the rest.

        Args:
            plan: The prompt's plan.
            reuse: ``False`` computes every token (the full-prefill baseline) and reads no cache.

        Returns:
            The outcome. When a warm's whole text was already stored, nothing is computed
            and ``logits`` is ``None``.
        """
        n = plan.num_tokens
        if not reuse:
            keys, values = self.adapter.buffers(n + plan.reserve)
            return self._exact(plan, keys, values, 0, ())
        pieces = self.cache.match_prefix(plan)
        h = sum(p.length for p in pieces)
        prefix_keys = tuple(p.key for p in pieces)
        documents = plan.documents_after(h)
        if h >= n:
            return PrefillOutcome(
                logits=None, cache=None, prefix_tokens=n, prefix_keys=prefix_keys, documents=documents,
                exact_until=n, strategy="exact",
            )
        hits = self._content_hits(plan, documents, h) if plan.content_reuse else {}
        keys, values = self.adapter.buffers(n + plan.reserve)
        for piece in pieces:
            end = piece.start + piece.length
            keys[:, :, piece.start : end] = piece.block.keys[:, :, : piece.length]
            values[:, :, piece.start : end] = piece.block.values[:, :, : piece.length]
        if not hits:
            outcome = self._exact(plan, keys, values, h, prefix_keys)
        else:
            outcome = self._blend(plan, keys, values, h, prefix_keys, hits)
        outcome.documents = documents
        outcome.merged_tokens = sum(d.merged_tokens for d in documents)
        return outcome

    # ------------------------------------------------------------------ exact path
    def _exact(
        self, plan: PromptPlan, keys: torch.Tensor, values: torch.Tensor, h: int, prefix_keys: tuple[str, ...]
    ) -> PrefillOutcome:
        """Prefill the tokens after the prefix hit on top of it (same logits as full prefill)."""
        ids = plan.tokens.ids
        n = len(ids)
        kv = self.adapter.cache_over(keys, values, h)
        # On top of a cache, transformers hands SDPA an explicit mask and it takes a slow path
        # (measured 35% slower per token than prefill from scratch on CPU); causal attention
        # by position over blocks of queries keeps the prefix hit cheaper than full prefill.
        logits = self.adapter.forward(torch.tensor(ids[h:]), torch.arange(h, n), kv, sparse_queries=h > 0)
        return PrefillOutcome(
            logits=logits,
            cache=kv,
            keys=keys,
            values=values,
            prefix_tokens=h,
            prefix_keys=prefix_keys,
            live_tokens=n - h,
            exact_until=n,
            strategy="exact" if h else "full",
        )

    # ------------------------------------------------------------------ document hits
    def _content_hits(self, plan: PromptPlan, documents: list[PlacedDocument], h: int) -> dict[str, ContentHit]:
        """Load the chunks of the documents after the prefix hit; keep the rows whose token
        matches the prompt's. The last prompt token is always computed (its logits are needed)."""
        ids = plan.tokens.ids
        last = len(ids) - 1
        hits: dict[str, ContentHit] = {}
        missing: set[str] = set()
        for document in documents:
            record = document.record
            for j, k in zip(document.positions, document.rows):
                if j < h or j == last:
                    continue
                chunk = k // record.chunk_size
                key = record.chunk_keys[chunk]
                if key in missing:
                    continue
                hit = hits.get(key)
                if hit is None:
                    block = self.cache.load(key)
                    if block is None:
                        missing.add(key)
                        continue
                    hit = hits[key] = ContentHit(block)
                row = k - chunk * record.chunk_size
                if row >= hit.block.num_tokens or int(hit.block.token_ids[row]) != ids[j]:
                    continue
                hit.rows.append(row)
                hit.positions.append(j)
        return {key: hit for key, hit in hits.items() if hit.positions}

    def _blend(
        self,
        plan: PromptPlan,
        keys: torch.Tensor,
        values: torch.Tensor,
        h: int,
        prefix_keys: tuple[str, ...],
        hits: dict[str, ContentHit],
    ) -> PrefillOutcome:
        """Stitch re-rotated document K/V after the prefix, repair, prefill the rest.

        ``keys``/``values`` are ``[layers, heads, capacity, dim]`` buffers holding the prefix;
        every other prompt position is written here or by the model call (cached rows below,
        computed rows by the scatter), so the buffers need no zero-filling.
        """
        adapter = self.adapter
        ids = plan.tokens.ids
        n = len(ids)
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
            recompute = self._select_cacheblend(ids, h, keys, values, content_positions, budget)
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
        logits = adapter.forward(torch.tensor(ids)[positions], positions, stitched, sparse_queries=True)
        first_content = int(content_positions[0]) if content_positions.numel() else n
        recomputed = int((cached & compute).sum())
        return PrefillOutcome(
            logits=logits,
            cache=stitched,
            keys=keys,
            values=values,
            prefix_tokens=h,
            prefix_keys=prefix_keys,
            loaded_chunks=frozenset(hits),
            content_tokens=int(content_positions.numel()),
            recomputed_tokens=recomputed,
            live_tokens=int(compute.sum()) - recomputed,
            exact_until=first_content,
            strategy=strategy,
        )

    def _select_cacheblend(
        self,
        ids: list[int],
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
        n = len(ids)
        check = min(self.settings.check_layer, adapter.num_layers - 1)
        cached_k = keys[check][:, content_positions].clone()
        cached_v = values[check][:, content_positions].clone()
        partial = adapter.cache_over(keys[: check + 1], values[: check + 1], h)
        adapter.forward_until_layer(torch.tensor(ids[h:]), torch.arange(h, n), partial, check)
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
