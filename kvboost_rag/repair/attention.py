"""The attention repair's choice: the cached tokens the prompt's last token attends to most."""

from __future__ import annotations

import torch

from kvboost_rag.attention import last_query_attention
from kvboost_rag.blend import budget_for_left, select_highest
from kvboost_rag.repair.base import RepairInputs, SelectingRepair, Selection


class AttentionRepair(SelectingRepair):
    """Recomputes the cached tokens whose staleness moves the answer most.

    The live tokens (computed whatever the repair: the question, separators, the last token)
    run once through every layer over the stitched cache as loaded, recording the last
    token's attention; the cached tokens with the most attention summed over layers are
    chosen. The K/V this probe writes for the live tokens is overwritten by the blend pass,
    which computes them again over the repaired cache. Used only for models whose attention
    the engine can record (probed at construction; else the engine uses
    :class:`~kvboost_rag.repair.cacheblend.CacheBlendRepair`).

    Args:
        adapter: The model adapter.
        settings: Engine settings (``max_stale_attention``, ratios).
    """

    name = "attention"

    def choose(self, inputs: RepairInputs) -> Selection:
        """The most attended cached tokens of the first filtering stage (sorted)."""
        content = inputs.content_positions
        count = int(content.numel())
        budget = inputs.budget
        if budget == 0:
            return Selection(content[:0])
        if budget is not None and budget >= count:  # every cached token: nothing to choose
            return Selection(content, self.stages.sizes(budget, count))
        adapter = self.adapter
        positions = inputs.live.nonzero().view(-1)
        probe = adapter.cache_over(inputs.keys, inputs.values, len(inputs.ids))
        probe.arm(positions.to(adapter.device))
        with last_query_attention() as recorded:
            adapter.forward(torch.tensor(inputs.ids)[positions], positions, probe, sparse_queries=True)
        attention = torch.stack(recorded).sum(dim=0)[content.to(adapter.device)].cpu()
        if budget is None:  # attention (averaged over layers) left on stale tokens <= max_stale_attention
            budget = budget_for_left(attention / len(recorded), self.settings.max_stale_attention, *self.stages.auto_bounds(count))
        sizes = self.stages.sizes(budget, count)
        return Selection(select_highest(content, attention, sizes[0]), sizes)
