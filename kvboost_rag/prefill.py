"""Prefill of a planned prompt: exact prefix hits, re-rotated document hits, CacheBlend repair.

:meth:`Prefiller.run` reads a :class:`~kvboost_rag.plan.PromptPlan`, loads what the cache
holds, runs the model once over the tokens that must be computed, and returns a
:class:`~kvboost_rag.outcome.PrefillOutcome` (last logits, a cache ready for decoding, and
what was reused). It stores nothing: write-back reads the outcome.

- Only prefix hits (or nothing cached): the prefix K/V goes into the buffers and the rest of
  the prompt is prefilled on top of it. Same logits as full prefill.
- Document hits: their K/V is re-rotated to the new positions and stitched with the prefix
  into full-length buffers. The attention strategy runs the tokens that are not cached once
  over the stitched cache and picks the cached tokens the last token attends to most;
  CacheBlend runs the non-prefix tokens through the first
  ``check_layer + 1`` layers into scratch buffers and picks the cached tokens whose K/V
  deviates most at ``check_layer``; the blend pass then runs only those plus the live tokens
  over the stitched cache, scattering their K/V into it with attention made causal by
  position. With ``blend_stages > 1`` the chosen set shrinks between layer spans to the
  tokens that still deviate most (gradual filtering). No pass over all cached tokens through
  the whole model.
"""

from __future__ import annotations

import logging
from functools import partial
from dataclasses import dataclass, field

import torch

from kvboost_rag.blend import leading_tokens, recompute_budget
from kvboost_rag.cache_manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.kv_codec import KVBlock
from kvboost_rag.outcome import PrefillOutcome
from kvboost_rag.plan import PlacedDocument, PromptPlan
from kvboost_rag.repair import RepairInputs, RepairStrategy, make_strategy
from kvboost_rag.repair.blend_pass import filtered_blend
from kvboost_rag.repair.lookahead import look_ahead
from kvboost_rag.repair.runs import contiguous_runs
from kvboost_rag.stage_times import stage

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
        self._strategies: dict[str, RepairStrategy] = {}

    @property
    def repair(self) -> RepairStrategy:
        """The repair strategy ``settings.recompute_strategy`` names (built once per name by
        :func:`~kvboost_rag.repair.make_strategy`, with its fallback; settings may change
        between calls)."""
        name = self.settings.recompute_strategy
        strategy = self._strategies.get(name)
        if strategy is None:
            strategy = self._strategies[name] = make_strategy(self.adapter, self.settings)
        return strategy

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
        with stage("lookup", self.adapter.device):
            pieces = self.cache.match_prefix(plan)
            h = sum(p.length for p in pieces)
            prefix_keys = tuple(p.key for p in pieces)
            documents = plan.documents_after(h)
            if h >= n:
                return PrefillOutcome(
                    logits=None, cache=None, prefix_tokens=n, prefix_keys=prefix_keys, documents=documents,
                    strategy="exact",
                )
            hits = self._content_hits(plan, documents, h) if plan.content_reuse else {}
        with stage("stitch", self.adapter.device):
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
            strategy="exact" if h else "full",
        )

    # ------------------------------------------------------------------ document hits
    def _content_hits(self, plan: PromptPlan, documents: list[PlacedDocument], h: int) -> dict[str, ContentHit]:
        """Load the chunks of the documents after the prefix hit and place their rows.

        The plan aligned each document row with a prompt token of the same id; a loaded chunk
        whose stored tokens differ from the document's (a colliding or tampered entry) is not
        used. Token ids are compared as host lists, once per chunk. The last prompt token is
        always computed (its logits are needed).
        """
        last = len(plan.tokens.ids) - 1
        hits: dict[str, ContentHit] = {}
        unusable: set[str] = set()
        for document in documents:
            record = document.record
            size = record.chunk_size
            for j, k in zip(document.positions, document.rows):
                if j < h or j == last:
                    continue
                chunk = k // size
                key = record.chunk_keys[chunk]
                if key in unusable:
                    continue
                hit = hits.get(key)
                if hit is None:
                    block = self.cache.load(key)
                    lo = chunk * size
                    if block is None or block.token_ids.tolist() != list(record.token_ids[lo : lo + record.chunk_length(chunk)]):
                        unusable.add(key)
                        continue
                    hit = hits[key] = ContentHit(block)
                hit.rows.append(k - chunk * size)
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
        with stage("stitch", adapter.device):
            for hit in hits.values():
                for row, position, length in _spans(hit.rows, hit.positions):
                    delta = position - (hit.block.start_position + row)
                    source = slice(row, row + length)
                    target = slice(position, position + length)
                    adapter.rotate_keys(hit.block.keys[:, :, source], delta, out=keys[:, :, target])
                    values[:, :, target] = hit.block.values[:, :, source]
                    cached[target] = True
        content_positions = cached.nonzero().view(-1)
        loaded = int(content_positions.numel())
        ratio = self.settings.recompute_ratio
        budget = None if ratio == "auto" else recompute_budget(loaded, ratio)
        live = ~cached  # computed whatever the repair: after the prefix, not loaded, and the last token
        live[:h] = False
        live[n - 1] = True
        repair = self.repair
        with stage("select", adapter.device):  # the probe inside it is timed apart
            selection = repair.choose(RepairInputs(ids, h, live, keys, values, content_positions, budget))
        recompute, stage_sizes = selection.positions, selection.stage_sizes
        keep = leading_tokens(contiguous_runs(content_positions), self.settings.keep_document_start)
        compute = live.clone()
        compute[recompute] = True
        compute[keep] = True
        positions = compute.nonzero().view(-1)

        stitched = adapter.cache_over(keys, values, n)
        input_ids = torch.tensor(ids)
        recomputed = float((cached & compute).sum())
        with stage("blend", adapter.device):
            if len(stage_sizes) > 1:
                logits, recomputed = filtered_blend(
                    adapter, self.settings.blend_stages, input_ids, positions, recompute, keep, stage_sizes, stitched
                )
            else:
                stitched.arm(positions.to(adapter.device))
                logits = adapter.forward(input_ids[positions], positions, stitched, sparse_queries=True)
        extra = recompute_budget(loaded, self.settings.lookahead_ratio) if repair.name == "attention" else 0
        follow_up = None
        if extra:  # after the first token is chosen: it reads the stale tokens it attends to most
            follow_up = partial(
                look_ahead, adapter, input_ids=input_ids, keys=keys, values=values, stitched=stitched,
                stale=cached & ~compute, budget=extra,
            )
        recomputed_tokens = round(recomputed)  # with gradual filtering: the mean per layer
        return PrefillOutcome(
            logits=logits,
            cache=stitched,
            keys=keys,
            values=values,
            prefix_tokens=h,
            prefix_keys=prefix_keys,
            loaded_chunks=frozenset(hits),
            content_tokens=loaded,
            recomputed_tokens=recomputed_tokens,
            live_tokens=int(live.sum()),
            strategy=repair.name,
            recompute_ratio=recomputed_tokens / loaded if loaded else 0.0,
            follow_up=follow_up,
        )


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
