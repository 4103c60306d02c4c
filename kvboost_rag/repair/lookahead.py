"""A second, smaller repair chosen by what the answer's first token reads.

The blend pass chose its tokens by the attention of the prompt's last token. The answer's
first token reads the documents too, sometimes other tokens: :func:`look_ahead_steps` runs the first
token once over the repaired cache (at the position it will be decoded at), records its
attention, and recomputes the stale cached tokens it attends to most. The first token itself
was already chosen from the blend pass's logits; the tokens after it read the refreshed K/V.
"""

from __future__ import annotations

import torch

from kvboost_rag.hf import BufferedCache, ModelAdapter
from kvboost_rag.hf.passes import PassSteps, TokenPass
from kvboost_rag.repair.probe import attention_scores, probe_steps
from kvboost_rag.repair.selection import select_highest


def look_ahead_steps(
    adapter: ModelAdapter,
    first_token: int,
    input_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    stitched: BufferedCache,
    stale: torch.Tensor,
    budget: int,
) -> PassSteps[int]:
    """Recompute the ``budget`` stale tokens the first answer token attends to most (prompt
    work: a probe of that token, then a pass of the chosen tokens).

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
    recorded = yield from probe_steps(adapter, torch.tensor([first_token]), torch.tensor([n]), keys, values, n + 1)
    if not recorded:
        return 0
    chosen = select_highest(candidates, attention_scores(recorded, candidates), budget)
    yield TokenPass(input_ids[chosen], chosen, stitched)
    return int(chosen.numel())
