"""A second, smaller repair chosen by what the answer's first token reads.

The blend pass chose its tokens by the attention of the prompt's last token. The answer's
first token reads the documents too, sometimes other tokens: :func:`look_ahead` runs the first
token once over the repaired cache (at the position it will be decoded at), records its
attention, and recomputes the stale cached tokens it attends to most. The first token itself
was already chosen from the blend pass's logits; the tokens after it read the refreshed K/V.
"""

from __future__ import annotations

import torch

from kvboost_rag.hf import BufferedCache, ModelAdapter
from kvboost_rag.hf.transfer import host_to_device
from kvboost_rag.repair.probe import attention_scores, run_probe
from kvboost_rag.repair.selection import select_highest


def look_ahead(
    adapter: ModelAdapter,
    first_token: int,
    input_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    stitched: BufferedCache,
    stale: torch.Tensor,
    budget: int,
) -> int:
    """Recompute the ``budget`` stale tokens the first answer token attends to most.

    Args:
        adapter: The model adapter.
        first_token: The answer's first token (chosen, not fed yet).
        input_ids: ``[n]`` every prompt token.
        keys: ``[layers, heads, capacity, dim]`` repaired K buffer; ``capacity > n`` (the
            probe writes row ``n``, which the first decode step overwrites).
        values: Same for V.
        stitched: The cache over the buffers (``n`` tokens) that decoding continues.
        stale: ``[n]`` bool, cached positions the blend pass did not recompute.
        budget: Stale tokens to recompute.

    Returns:
        The number of stale tokens recomputed.
    """
    n = int(input_ids.numel())
    candidates = stale.nonzero().view(-1)
    if budget <= 0 or candidates.numel() == 0 or keys.shape[2] <= n:
        return 0
    recorded = run_probe(adapter, torch.tensor([first_token]), torch.tensor([n]), keys, values, n + 1)
    if not recorded:
        return 0
    chosen = select_highest(candidates, attention_scores(recorded, candidates), budget)
    stitched.arm(host_to_device(chosen, adapter.device))
    adapter.forward(input_ids[chosen], chosen, stitched, sparse_queries=True)
    return int(chosen.numel())
