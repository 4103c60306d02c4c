"""The attention repair's probe: which cached tokens the prompt's last tokens read.

The probe runs the live tokens (those computed whatever the repair: question, separators,
the last token) over the stitched cache as loaded, with no repair, and records the attention
of the last ``queries`` of them, in the first ``layers`` decoder layers. Its cost is one pass
of the live tokens, with no logits; the live tokens' K/V it writes is overwritten by the blend
pass either way. It is one :class:`~kvboost_rag.hf.passes.TokenPass` of prompt work
(:func:`probe_steps`): the engine loop runs it in slices beside other work, the last slice
holding the recorded queries.

:func:`attention_scores` turns the recorded attention into one score per cached token.
"""

from __future__ import annotations

import torch

from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.passes import PassResult, PassSteps, TokenPass, run_now


def probe_steps(
    adapter: ModelAdapter,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: int,
    *,
    layers: int | None = None,
    queries: int = 1,
) -> PassSteps[list[torch.Tensor]]:
    """Run the live tokens over the stitched cache and record what their last ones attend to
    (prompt work: one token pass).

    Args:
        adapter: The model adapter.
        input_ids: ``[live]`` the live tokens.
        positions: ``[live]`` their sorted positions.
        keys: ``[layers, heads, capacity, dim]`` stitched K buffer (the live rows are written).
        values: Same for V.
        length: Prompt tokens.
        layers: Decoder layers recorded, from the first; ``None`` (or the model's depth): all.
        queries: How many of the last live tokens' attention to record (sum over them).

    Returns:
        One ``[length]`` tensor per layer recorded (empty when the model's attention does not
        go through the registered attention function).
    """
    probe = adapter.cache_over(keys, values, length)
    depth = adapter.num_layers if layers is None else max(1, min(layers, adapter.num_layers))
    result: PassResult = yield TokenPass(input_ids, positions, probe, record=queries, record_layers=depth)
    return result.recorded


def run_probe(
    adapter: ModelAdapter,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: int,
    *,
    layers: int | None = None,
    queries: int = 1,
    slice_tokens: int | None = None,
) -> list[torch.Tensor]:
    """:func:`probe_steps` at once, on this thread (tools and tests), its pass whole or in
    slices of ``slice_tokens``."""
    steps = probe_steps(adapter, input_ids, positions, keys, values, length, layers=layers, queries=queries)
    return run_now(adapter, steps, slice_tokens)


def attention_scores(
    recorded: list[torch.Tensor],
    content_positions: torch.Tensor,
    values: torch.Tensor | None = None,
    depth_weighted: bool = False,
) -> torch.Tensor:
    """One score per cached token: the recorded attention summed over layers.

    Args:
        recorded: ``[length]`` attention per layer (from :func:`run_probe`).
        content_positions: ``[tokens]`` positions of the cached tokens.
        values: ``[layers, heads, capacity, dim]`` the stitched V buffer: when given, each
            layer's attention is weighted by the norm of the token's cached value there
            (relative to the mean over the cached tokens), since what a token adds to the
            output is its weight times its value.
        depth_weighted: Weight layer ``l`` by ``2 l / (layers - 1)`` (mean 1): a cached
            token's K/V is exact in the first layer (it depends on the token and its position
            only) and drifts from full prefill's more in each layer above.

    Returns:
        ``[tokens]`` float32 scores on the CPU; their mean over layers is the last tokens'
        attention left on each token (what ``max_stale_attention`` bounds).
    """
    index = content_positions.to(recorded[0].device)
    attention = torch.stack(recorded)[:, index]  # [layers, tokens]
    if values is not None:
        norms = values[: len(recorded)][:, :, index].float().norm(dim=-1).mean(dim=1)  # [layers, tokens]
        attention = attention * norms / norms.mean(dim=1, keepdim=True).clamp_min(1e-12)
    if depth_weighted and len(recorded) > 1:
        depth = torch.arange(len(recorded), device=attention.device, dtype=attention.dtype)
        attention = attention * (2 * depth / (len(recorded) - 1)).view(-1, 1)
    return attention.sum(dim=0).float().cpu()
