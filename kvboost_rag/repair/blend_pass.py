"""The blend pass: the chosen cached tokens and the live tokens run over the stitched cache.

With one stage the pass is one model call over the armed cache (the chosen and live tokens'
K/V scattered into it, attention causal by position). With ``blend_stages > 1``,
:func:`filtered_blend` runs CacheBlend's gradual filtering.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost_rag.hf import BufferedCache, ModelAdapter
from kvboost_rag.transfer import host_to_device
from kvboost_rag.repair.selection import kv_deviation, layer_spans


def filtered_blend(
    adapter: ModelAdapter,
    blend_stages: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    chosen: torch.Tensor,
    keep: torch.Tensor,
    sizes: Sequence[int],
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
    keys, values = adapter.cache_tensors(stitched)  # [L, H, n, D] each, views of the stitched buffers
    spans = layer_spans(adapter.num_layers, blend_stages)
    current = chosen[~torch.isin(chosen, keep)]  # [c] cached positions still being recomputed
    token_layers = float(keep.numel() * adapter.num_layers)
    hidden: torch.Tensor | None = None
    for k, (low, high) in enumerate(spans):
        stitched.arm(host_to_device(positions, adapter.device), first_layer=low)
        token_layers += current.numel() * (high - low + 1)
        if k == len(spans) - 1:
            logits = adapter.forward_from_layer(input_ids[positions], positions, stitched, low, hidden)
            break
        rows = host_to_device(current, adapter.device)  # [c]
        saved_keys = keys[low : high + 1][:, :, rows].clone()  # [span, H, c, D] cached K of the span
        saved_values = values[low : high + 1][:, :, rows].clone()  # [span, H, c, D]
        hidden = adapter.hidden_through_layers(input_ids[positions], positions, stitched, low, high, hidden)  # [1, p, hidden]
        deviation = kv_deviation(keys[high][:, rows], values[high][:, rows], saved_keys[-1], saved_values[-1])  # [c]
        goes_on = torch.zeros(current.numel(), dtype=torch.bool)  # [c] host mask
        goes_on[torch.topk(deviation.cpu(), k=min(sizes[k + 1], current.numel())).indices] = True
        leaving = host_to_device(~goes_on, adapter.device)  # [c]
        keys[low : high + 1][:, :, rows[leaving]] = saved_keys[:, :, leaving]  # [span, H, left, D] restored
        values[low : high + 1][:, :, rows[leaving]] = saved_values[:, :, leaving]
        stays = ~torch.isin(positions, current[~goes_on])  # [p] host mask of the positions going on
        positions = positions[stays]
        hidden = hidden[:, host_to_device(stays, adapter.device)]  # [1, p', hidden]
        current = current[goes_on]
    return logits, token_layers / adapter.num_layers
