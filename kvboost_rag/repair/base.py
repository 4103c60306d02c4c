"""The interface every repair strategy implements, and what it is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvboost_rag.config import KVBoostSettings
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.passes import PassSteps
from kvboost_rag.repair.selection import layer_spans, recompute_budget, stage_sizes


@dataclass(frozen=True)
class RepairInputs:
    """A stitched prompt whose document K/V came from cache at new positions.

    Attributes:
        ids: ``[n]`` int64 host tensor, every prompt token.
        prefix_tokens: Tokens served by the exact prefix hit (``h``).
        live: ``[n]`` bool, positions computed whatever the repair (after the prefix, not
            loaded, and the last token).
        keys: ``[layers, heads, capacity, dim]`` stitched keys (prefix, re-rotated documents).
        values: Same for values.
        content_positions: Sorted positions whose K/V was loaded from document chunks.
        budget: Cached tokens to recompute, or ``None`` for ``recompute_ratio="auto"``.
        captured_probe: Runs the probe as one captured pass when it can: ``(tokens,
            positions, queries)`` -> what :func:`~kvboost_rag.repair.probe.run_probe` returns
            over every layer, or ``None`` (then the probe runs eagerly).
        chunk_tokens: Most tokens of a selection pass that runs whole (CacheBlend's pass
            through its first layers runs in chunks of this many).
    """

    ids: torch.Tensor
    prefix_tokens: int
    live: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    content_positions: torch.Tensor
    budget: int | None
    captured_probe: Callable[[torch.Tensor, torch.Tensor, int], list[torch.Tensor] | None] | None = None
    chunk_tokens: int = 1 << 30


@dataclass(frozen=True)
class Selection:
    """What a strategy chose: the cached positions to recompute (sorted) and, for gradual
    filtering, the set size of every stage of the blend pass (one stage or none: a plain pass)."""

    positions: torch.Tensor
    stage_sizes: tuple[int, ...] = ()


class RepairStrategy(Protocol):
    """Chooses which cached document tokens the blend pass recomputes."""

    #: The name results report (``GenerationResult.strategy``).
    name: str

    def choose(self, inputs: RepairInputs) -> PassSteps[Selection]:
        """The tokens to recompute for one stitched prompt (prompt work: the passes it
        needs are yielded, see :mod:`kvboost_rag.hf.passes`)."""
        ...


class SelectingRepair:
    """Base of the strategies that run a selection pass through the model.

    Args:
        adapter: The model adapter.
        settings: Engine settings (ratios, ``blend_stages`` and the strategy's own targets).
    """

    name = ""

    def __init__(self, adapter: ModelAdapter, settings: KVBoostSettings) -> None:
        self.adapter = adapter
        self.settings = settings

    def auto_bounds(self, count: int) -> tuple[int, int]:
        """Least and largest budget ``recompute_ratio="auto"`` may pick among ``count`` tokens."""
        settings = self.settings
        return recompute_budget(count, settings.min_recompute_ratio), recompute_budget(count, settings.max_recompute_ratio)

    def stage_sizes(self, budget: int, count: int) -> tuple[int, ...]:
        """Set size of each ``blend_stages`` stage for ``budget`` tokens among ``count``."""
        spans = layer_spans(self.adapter.num_layers, self.settings.blend_stages)
        return tuple(stage_sizes(budget, [last - first + 1 for first, last in spans], count))
