"""Choosing which reused tokens to recompute (attention, CacheBlend, selective, none).

Pure tensor functions: they take positions and K/V and return positions; running the model
over the chosen tokens is the engine's job (one forward pass over a stitched cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def recompute_budget(candidates: int, ratio: float) -> int:
    """Number of tokens to recompute among ``candidates`` at ``ratio`` (rounded up)."""
    if candidates <= 0 or ratio <= 0:
        return 0
    return min(candidates, math.ceil(candidates * ratio))


def adaptive_budget(deviation: torch.Tensor, scale: torch.Tensor, target: float, low: int, high: int) -> int:
    """Fewest tokens to recompute so that the mean relative deviation left is ``<= target``.

    Args:
        deviation: ``[tokens]`` squared K/V deviation of each cached token.
        scale: ``[tokens]`` squared norm of each token's fresh K/V (makes it relative).
        target: Mean relative deviation allowed in the tokens left as cached.
        low: Least number of tokens to recompute.
        high: Largest number of tokens to recompute.
    """
    relative = deviation / scale.clamp_min(torch.finfo(torch.float32).tiny)
    return budget_for_left(relative, target * deviation.numel(), low, high)


def budget_for_left(scores: torch.Tensor, allowed: float, low: int, high: int) -> int:
    """Fewest top-scoring tokens to recompute so that the scores left sum to ``<= allowed``.

    With the last token's attention to each cached token (averaged over layers) as scores,
    ``allowed`` is the share of that attention that may stay on stale tokens.

    Args:
        scores: ``[tokens]`` non-negative score of each cached token.
        allowed: Largest sum of the scores of the tokens left as cached.
        low: Least number of tokens to recompute.
        high: Largest number of tokens to recompute.
    """
    count = int(scores.numel())
    if count == 0:
        return 0
    ranked = scores.float().sort(descending=True).values
    left = ranked.sum() - torch.cumsum(ranked, 0)  # left[k - 1]: what is left after k recomputed
    within = (left <= allowed).nonzero()
    needed = int(within[0]) + 1 if within.numel() else count
    if float(ranked.sum()) <= allowed:
        needed = 0
    return max(low, min(high, needed))


def kv_deviation(
    fresh_keys: torch.Tensor, fresh_values: torch.Tensor, cached_keys: torch.Tensor, cached_values: torch.Tensor
) -> torch.Tensor:
    """Per-token squared K/V deviation at one layer.

    Args:
        fresh_keys: ``[heads, tokens, dim]`` K computed in the prompt's context.
        fresh_values: Same for V.
        cached_keys: ``[heads, tokens, dim]`` K loaded from cache (re-rotated).
        cached_values: Same for V.

    Returns:
        ``[tokens]`` float32 deviation.
    """
    dk = (fresh_keys.float() - cached_keys.float()).pow(2).sum(dim=(0, 2))  # [tokens]
    dv = (fresh_values.float() - cached_values.float()).pow(2).sum(dim=(0, 2))
    return dk + dv


def kv_energy(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-token squared norm of K and V at one layer (``[heads, tokens, dim]`` each -> ``[tokens]``)."""
    return keys.float().pow(2).sum(dim=(0, 2)) + values.float().pow(2).sum(dim=(0, 2))


def select_highest(positions: torch.Tensor, scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The ``budget`` positions with the highest score (sorted): CacheBlend scores by K/V
    deviation, the attention strategy by the last token's attention."""
    if budget <= 0 or positions.numel() == 0:
        return positions[:0]
    top = torch.topk(scores, k=min(budget, positions.numel())).indices  # [budget] indexes into positions
    return positions[top].sort().values


def select_document_starts(runs: Sequence[torch.Tensor], budget: int) -> torch.Tensor:
    """Selective: the first tokens of each reused run, sharing ``budget`` by run length.

    Args:
        runs: Positions of each contiguous reused run (one per document piece), sorted.
        budget: Total tokens to recompute.
    """
    total = sum(int(r.numel()) for r in runs)
    if budget <= 0 or total == 0:
        return torch.empty(0, dtype=torch.long)
    chosen: list[torch.Tensor] = []
    for run in runs:
        share = min(int(run.numel()), math.ceil(budget * run.numel() / total))
        chosen.append(run[:share])
    return torch.cat(chosen).sort().values


def leading_tokens(runs: Sequence[torch.Tensor], count: int) -> torch.Tensor:
    """The first ``count`` positions of every run (kept fresh regardless of the strategy)."""
    if count <= 0 or not runs:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([run[:count] for run in runs]).unique(sorted=True)


def stage_sizes(budget: int, span_lengths: Sequence[int], candidates: int) -> list[int]:
    """Set size of each gradual-filtering stage, largest first, averaging ``budget`` per layer.

    Sizes fall linearly (two stages of equal spans: 1.5x then 0.5x the budget), scaled so that
    the token-layers computed equal recomputing ``budget`` tokens in every layer. Sizes are
    capped at ``candidates``; what a cap cuts goes to the later stages, so a budget of every
    candidate recomputes every candidate in every layer.

    Args:
        budget: Tokens to recompute per layer on average.
        span_lengths: Layers in each stage's span.
        candidates: Tokens that can be chosen.
    """
    budget = min(budget, candidates)
    stages = len(span_lengths)
    if budget <= 0:
        return [0] * max(stages, 1)
    if stages <= 1:
        return [budget]
    weights = [(2 * (stages - k) - 1) / stages for k in range(stages)]
    scale = sum(span_lengths) / sum(w * length for w, length in zip(weights, span_lengths))
    sizes = [min(candidates, max(1, round(budget * scale * w))) for w in weights]
    missing = budget * sum(span_lengths) - sum(size * length for size, length in zip(sizes, span_lengths))
    for k in range(1, stages):
        if missing <= 0:
            break
        added = min(missing // span_lengths[k], sizes[k - 1] - sizes[k])
        sizes[k] += added
        missing -= added * span_lengths[k]
    return sizes


def layer_spans(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Split layers ``0..num_layers-1`` into ``stages`` contiguous ``(first, last)`` spans."""
    edges = [round(num_layers * k / stages) for k in range(stages + 1)]
    return [(edges[k], edges[k + 1] - 1) for k in range(stages) if edges[k + 1] > edges[k]]
