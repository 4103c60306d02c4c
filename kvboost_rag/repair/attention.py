"""The attention repair's choice: the cached tokens the prompt's last token attends to most."""

from __future__ import annotations

from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.hf.passes import ModelCall, PassSteps
from kvboost_rag.repair.base import RepairInputs, SelectingRepair, Selection
from kvboost_rag.repair.probe import attention_scores, probe_steps
from kvboost_rag.repair.selection import budget_for_left, select_highest


class AttentionRepair(SelectingRepair):
    """Recomputes the cached tokens whose staleness moves the answer most.

    The live tokens (computed whatever the repair: the question, separators, the last token)
    run once over the stitched cache as loaded (:mod:`~kvboost_rag.repair.probe`: every layer,
    or the first ``probe_layers``), recording the attention of the last ``probe_queries``
    tokens; the cached tokens with the most attention summed over layers (weighted as
    ``probe_weighting`` says) are chosen. The K/V this probe writes for the live tokens is overwritten by the blend pass,
    which computes them again over the repaired cache. Used only for models whose attention
    the engine can record (probed at construction; else the engine uses
    :class:`~kvboost_rag.repair.cacheblend.CacheBlendRepair`).

    Args:
        adapter: The model adapter.
        settings: Engine settings (``max_stale_attention``, ratios).
    """

    name = "attention"

    def choose(self, inputs: RepairInputs) -> PassSteps[Selection]:
        """The most attended cached tokens of the first filtering stage (sorted)."""
        content = inputs.content_positions
        count = int(content.numel())
        budget = inputs.budget
        if budget == 0:
            return Selection(content[:0])
        if budget is not None and budget >= count:  # every cached token: nothing to choose
            return Selection(content, self.stage_sizes(budget, count))
        adapter, settings = self.adapter, self.settings
        positions = inputs.live.nonzero().view(-1)
        with stage("probe", adapter.device):
            recorded = None
            captured = inputs.captured_probe
            if captured is not None and settings.probe_layers in (None, adapter.num_layers):
                ids, queries = inputs.ids[positions], settings.probe_queries
                recorded = yield ModelCall(lambda: captured(ids, positions, queries), int(positions.numel()))
            if recorded is None:
                recorded = yield from probe_steps(
                    adapter, inputs.ids[positions], positions, inputs.keys, inputs.values, len(inputs.ids),
                    layers=settings.probe_layers, queries=settings.probe_queries,
                )
        weighting = settings.probe_weighting
        attention = attention_scores(
            recorded, content, inputs.values if "value" in weighting else None, depth_weighted="depth" in weighting
        )
        attention = attention / min(settings.probe_queries, len(positions))
        if budget is None:  # attention (averaged over layers) left on stale tokens <= max_stale_attention
            budget = budget_for_left(attention / len(recorded), self.settings.max_stale_attention, *self.auto_bounds(count))
        sizes = self.stage_sizes(budget, count)
        return Selection(select_highest(content, attention, sizes[0]), sizes)
