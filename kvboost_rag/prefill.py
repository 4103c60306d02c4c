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
from dataclasses import dataclass, field

import torch

from kvboost_rag.blend import (
    adaptive_budget,
    budget_for_left,
    kv_deviation,
    kv_energy,
    layer_spans,
    leading_tokens,
    recompute_budget,
    select_document_starts,
    select_highest,
    stage_sizes,
)
from kvboost_rag.cache_manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.kv_codec import KVBlock
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.model_adapter import BufferedCache, ModelAdapter
from kvboost_rag.outcome import PrefillOutcome
from kvboost_rag.plan import PlacedDocument, PromptPlan
from kvboost_rag.probe import attention_scores, run_probe
from kvboost_rag.stage_times import stage

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)


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
        with stage("lookup", self.adapter.device):
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
        strategy = self.settings.recompute_strategy
        stage_sizes: list[int] = []
        with stage("select", adapter.device):  # the probe inside it is timed apart (bench subtracts it)
            recompute, stage_sizes = self._choose(strategy, ids, h, live, keys, values, content_positions, budget)
        keep = leading_tokens(_runs(content_positions), self.settings.keep_document_start)
        compute = live.clone()
        compute[recompute] = True
        compute[keep] = True
        positions = compute.nonzero().view(-1)

        stitched = adapter.cache_over(keys, values, n)
        input_ids = torch.tensor(ids)
        recomputed = float((cached & compute).sum())
        with stage("blend", adapter.device):
            if len(stage_sizes) > 1:
                logits, recomputed = self._filtered_blend(input_ids, positions, recompute, keep, stage_sizes, stitched)
            else:
                stitched.arm(positions.to(adapter.device))
                logits = adapter.forward(input_ids[positions], positions, stitched, sparse_queries=True)
        first_content = int(content_positions[0]) if loaded else n
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
            exact_until=first_content,
            strategy=strategy,
            recompute_ratio=recomputed_tokens / loaded if loaded else 0.0,
        )

    def _choose(
        self,
        strategy: str,
        ids: list[int],
        h: int,
        live: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        content_positions: torch.Tensor,
        budget: int | None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The cached positions ``strategy`` recomputes (sorted) and the blend's stage sizes."""
        if strategy == "cacheblend":
            return self._select_cacheblend(ids, h, keys, values, content_positions, budget)
        if strategy == "attention":
            chosen = self._select_by_attention(ids, live, keys, values, content_positions, budget)
            if chosen is None:
                chosen = self._select_cacheblend(ids, h, keys, values, content_positions, budget)
            return chosen
        if strategy == "selective":
            return select_document_starts(_runs(content_positions), budget), []
        return content_positions[:0], []

    def _select_cacheblend(
        self,
        ids: list[int],
        h: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        content_positions: torch.Tensor,
        budget: int | None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Choose the cached tokens to recompute from their K/V deviation at ``check_layer``.

        The tokens after the prefix run through layers ``0..check_layer`` into scratch
        buffers; the stitched ``keys``/``values`` are left as they are. (Writing those fresh
        shallow layers into the cache would leave the tokens not chosen with exact shallow
        layers over stale deep ones, a mix measured worse than a consistently stale cache.)

        Args:
            budget: Tokens to recompute, or ``None`` to size it from the deviation
                (``recompute_ratio="auto"``).

        Returns:
            The tokens of the first filtering stage (the most deviating ones, sorted) and the
            set size of every stage (:func:`~kvboost_rag.blend.stage_sizes`); one stage when
            ``blend_stages`` is 1.
        """
        if budget == 0:
            return content_positions[:0], []
        adapter = self.adapter
        n = len(ids)
        check = min(self.settings.check_layer, adapter.num_layers - 1)
        fresh_keys, fresh_values = adapter.buffers(n, layers=check + 1)
        fresh_keys[:, :, :h] = keys[: check + 1, :, :h]
        fresh_values[:, :, :h] = values[: check + 1, :, :h]
        partial = adapter.cache_over(fresh_keys, fresh_values, h)
        with stage("probe", adapter.device):
            adapter.forward_until_layer(torch.tensor(ids[h:]), torch.arange(h, n), partial, check)
        fresh_k = fresh_keys[check][:, content_positions]
        fresh_v = fresh_values[check][:, content_positions]
        deviation = kv_deviation(fresh_k, fresh_v, keys[check][:, content_positions], values[check][:, content_positions])
        count = int(content_positions.numel())
        if budget is None:
            low, high = self._auto_bounds(count)
            budget = adaptive_budget(deviation, kv_energy(fresh_k, fresh_v), self.settings.max_deviation, low, high)
        sizes = self._stage_sizes(budget, count)
        return select_highest(content_positions, deviation.cpu(), sizes[0]), sizes

    def _auto_bounds(self, count: int) -> tuple[int, int]:
        """Least and largest budget ``recompute_ratio="auto"`` may pick among ``count`` tokens."""
        settings = self.settings
        return recompute_budget(count, settings.min_recompute_ratio), recompute_budget(count, settings.max_recompute_ratio)

    def _stage_sizes(self, budget: int, count: int) -> list[int]:
        """Set size of each ``blend_stages`` stage for ``budget`` tokens among ``count``."""
        spans = layer_spans(self.adapter.num_layers, self.settings.blend_stages)
        return stage_sizes(budget, [last - first + 1 for first, last in spans], count)

    def _select_by_attention(
        self,
        ids: list[int],
        live: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        content_positions: torch.Tensor,
        budget: int | None,
    ) -> tuple[torch.Tensor, list[int]] | None:
        """Choose the cached tokens the prompt's last token attends to most.

        The live tokens (computed whatever the repair: the question, separators, the last
        token) run once through every layer over the stitched cache as loaded, with no
        repair, recording the last token's attention; the cached tokens with the most
        attention summed over layers are the ones whose staleness moves the answer most.
        The K/V this pass writes for the live tokens is overwritten by the blend pass, which
        computes them again over the repaired cache.

        Args:
            live: ``[n]`` bool, the positions computed whatever the repair.
            budget: Tokens to recompute, or ``None`` to size it from the attention
                (``recompute_ratio="auto"``).

        Returns:
            The chosen positions (sorted) and the stage sizes for the blend pass; ``None``
            (with a warning) when the model's attention could not be recorded.
        """
        count = int(content_positions.numel())
        if budget == 0:
            return content_positions[:0], []
        if budget is not None and budget >= count:  # every cached token: nothing to choose
            return content_positions, self._stage_sizes(budget, count)
        adapter = self.adapter
        settings = self.settings
        positions = live.nonzero().view(-1)
        with stage("probe", adapter.device):
            recorded = run_probe(
                adapter, torch.tensor(ids)[positions], positions, keys, values, len(ids),
                layers=settings.probe_layers, queries=settings.probe_queries,
            )
        if not recorded:  # the model's attention does not go through the registered function
            _warnings.warning(
                "attention_not_recorded",
                "%s does not route attention through transformers' AttentionInterface; choosing "
                "the tokens to recompute by CacheBlend's K/V deviation instead",
                type(adapter.model).__name__,
            )
            return None
        weighting = settings.probe_weighting
        attention = attention_scores(
            recorded, content_positions, values if "value" in weighting else None, depth_weighted="depth" in weighting
        )
        attention = attention / min(settings.probe_queries, len(positions))
        if budget is None:  # attention (averaged over layers) left on stale tokens <= max_stale_attention
            budget = budget_for_left(attention / len(recorded), self.settings.max_stale_attention, *self._auto_bounds(count))
        sizes = self._stage_sizes(budget, count)
        return select_highest(content_positions, attention, sizes[0]), sizes

    def _filtered_blend(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        chosen: torch.Tensor,
        keep: torch.Tensor,
        sizes: list[int],
        stitched: BufferedCache,
    ) -> tuple[torch.Tensor, float]:
        """CacheBlend's gradual filtering: the blend pass runs the layers in ``len(sizes)``
        spans; after each span but the last, only the ``sizes[k + 1]`` chosen tokens whose K/V
        deviated most at the span's last layer go on. Live tokens and ``keep`` go through
        every layer.

        A token that leaves gets its cached K/V back in the layers it ran, so every cached
        token's K/V is either cached in all layers or fresh where it was recomputed from
        layer 0 up: decoding then sees no fresh-over-stale mix.

        Args:
            input_ids: Every prompt token.
            positions: Sorted positions computed in the first span (``chosen``, ``keep``, live).
            chosen: Sorted cached positions chosen for the first span.
            keep: Cached positions recomputed in every layer (``keep_document_start``).
            sizes: Set size per span, the first one ``len(chosen)``.
            stitched: The armed-to-be cache over the stitched buffers.

        Returns:
            Last logits and the mean number of cached tokens recomputed per layer.
        """
        adapter = self.adapter
        keys, values = adapter.cache_tensors(stitched)
        spans = layer_spans(adapter.num_layers, self.settings.blend_stages)
        current = chosen[~torch.isin(chosen, keep)]
        token_layers = float(keep.numel() * adapter.num_layers)
        hidden: torch.Tensor | None = None
        for k, (low, high) in enumerate(spans):
            stitched.arm(positions.to(adapter.device), first_layer=low)
            token_layers += current.numel() * (high - low + 1)
            if k == len(spans) - 1:
                logits = adapter.forward_from_layer(input_ids[positions], positions, stitched, low, hidden)
                break
            rows = current.to(adapter.device)
            saved_keys = keys[low : high + 1][:, :, rows].clone()
            saved_values = values[low : high + 1][:, :, rows].clone()
            hidden = adapter.hidden_through_layers(input_ids[positions], positions, stitched, low, high, hidden)
            deviation = kv_deviation(keys[high][:, rows], values[high][:, rows], saved_keys[-1], saved_values[-1])
            goes_on = torch.zeros(current.numel(), dtype=torch.bool)
            goes_on[torch.topk(deviation.cpu(), k=min(sizes[k + 1], current.numel())).indices] = True
            leaving = (~goes_on).to(adapter.device)
            keys[low : high + 1][:, :, rows[leaving]] = saved_keys[:, :, leaving]
            values[low : high + 1][:, :, rows[leaving]] = saved_values[:, :, leaving]
            stays = ~torch.isin(positions, current[~goes_on])
            positions = positions[stays]
            hidden = hidden[:, stays.to(adapter.device)]
            current = current[goes_on]
        return logits, token_layers / adapter.num_layers


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
