"""CacheBlend's choice: the cached tokens whose K/V deviates most at ``check_layer``."""

from __future__ import annotations

import torch

from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.hf.passes import ModelCall, PassSteps
from kvboost_rag.transfer import host_to_device
from kvboost_rag.repair.base import RepairInputs, SelectingRepair, Selection
from kvboost_rag.repair.selection import (
    adaptive_budget,
    kv_deviation,
    kv_energy,
    select_highest,
)


class CacheBlendRepair(SelectingRepair):
    """Recomputes the cached tokens whose K/V deviates most from a fresh computation.

    The tokens after the prefix run through layers ``0..check_layer`` into scratch buffers;
    the stitched K/V is left as it is. (Writing those fresh shallow layers into the cache would
    leave the tokens not chosen with exact shallow layers over stale deep ones, a mix measured
    worse than a consistently stale cache.)

    Args:
        adapter: The model adapter.
        settings: Engine settings (``check_layer``, ``max_deviation``, ratios).
    """

    name = "cacheblend"

    def choose(self, inputs: RepairInputs) -> PassSteps[Selection]:
        """The most deviating cached tokens of the first filtering stage (sorted); the pass
        through layers ``0..check_layer`` runs in chunks of ``inputs.chunk_tokens``, each
        whole (a :class:`~kvboost_rag.hf.passes.ModelCall`: it stops after a chosen layer)."""
        content = inputs.content_positions
        if inputs.budget == 0:
            return Selection(content[:0])
        adapter, ids, h = self.adapter, inputs.ids, inputs.prefix_tokens
        n = len(ids)
        check = min(self.settings.check_layer, adapter.num_layers - 1)
        fresh_keys, fresh_values = adapter.buffers(n, layers=check + 1)
        fresh_keys[:, :, :h] = inputs.keys[: check + 1, :, :h]
        fresh_values[:, :, :h] = inputs.values[: check + 1, :, :h]
        partial = adapter.cache_over(fresh_keys, fresh_values, h)
        with stage("probe", adapter.device):
            for start in range(h, n, max(1, inputs.chunk_tokens)):  # layers 0..check of every token after the prefix
                stop = min(n, start + max(1, inputs.chunk_tokens))
                positions = torch.arange(start, stop)
                yield ModelCall(
                    lambda tokens=ids[start:stop], at=positions: adapter.hidden_through_layers(
                        tokens, at, partial, 0, check, None
                    ),
                    stop - start,
                )
        rows = host_to_device(content, adapter.device)
        fresh_k, fresh_v = fresh_keys[check][:, rows], fresh_values[check][:, rows]
        deviation = kv_deviation(fresh_k, fresh_v, inputs.keys[check][:, rows], inputs.values[check][:, rows])
        count = int(content.numel())
        budget = inputs.budget
        if budget is None:
            low, high = self.auto_bounds(count)
            budget = adaptive_budget(deviation, kv_energy(fresh_k, fresh_v), self.settings.max_deviation, low, high)
        sizes = self.stage_sizes(budget, count)
        return Selection(select_highest(content, deviation.cpu(), sizes[0]), sizes)
