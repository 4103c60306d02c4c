"""Repair strategies: which cached document tokens the blend pass recomputes.

One strategy is chosen per engine (:func:`make_strategy`) behind one interface
(:class:`~kvboost_rag.repair.base.RepairStrategy`): ``attention`` (what the last token
attends to), ``cacheblend`` (K/V deviation at ``check_layer``), ``selective`` (document
starts) and ``none``. The blend pass itself, with gradual filtering, is
:mod:`kvboost_rag.repair.blend_pass`. A result's ``strategy`` names the one that ran.
"""

from __future__ import annotations

import logging

from kvboost_rag.config import KVBoostSettings
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.repair.attention import AttentionRepair
from kvboost_rag.repair.base import RepairInputs, RepairStrategy, Selection
from kvboost_rag.repair.cacheblend import CacheBlendRepair
from kvboost_rag.repair.simple import NoRepair, SelectiveRepair

logger = logging.getLogger(__name__)

__all__ = ["RepairInputs", "RepairStrategy", "Selection", "make_strategy"]


def make_strategy(adapter: ModelAdapter, settings: KVBoostSettings) -> RepairStrategy:
    """The strategy ``settings.recompute_strategy`` names, or its documented fallback.

    The attention strategy needs the model's attention to go through transformers' attention
    interface (probed when the adapter is built); where it does not, the engine repairs with
    CacheBlend, says so once, and results report ``strategy="cacheblend"``.
    """
    name = settings.recompute_strategy
    if name == "attention" and not adapter.features.records_attention:
        logger.warning(
            "%s does not route attention through transformers' AttentionInterface; repairing documents with "
            "CacheBlend's K/V deviation instead of the attention repair (results report strategy='cacheblend')",
            type(adapter.model).__name__,
        )
        name = "cacheblend"
    if name == "attention":
        return AttentionRepair(adapter, settings)
    if name == "cacheblend":
        return CacheBlendRepair(adapter, settings)
    if name == "selective":
        return SelectiveRepair()
    return NoRepair()
