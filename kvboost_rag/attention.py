"""Causal attention for a sparse set of query positions over a full-length cache.

The blend pass runs only chosen tokens (at scattered positions) against the K/V of every
prompt token. A dense 4D mask makes each query attend over all keys and throws half the work
away; this attention function instead splits the sorted queries into blocks and lets each
block attend only to the keys up to its last position, which roughly halves the attention
cost of the blend pass. It is registered with transformers' ``AttentionInterface`` and used
only while :func:`query_positions` is active.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "kvboost_sparse_causal"
_QUERY_BLOCK = 32
_state = threading.local()


@contextlib.contextmanager
def query_positions(positions: torch.Tensor) -> Iterator[None]:
    """Within the block, the registered attention treats queries as sitting at ``positions``.

    Args:
        positions: Sorted ``[queries]`` absolute positions of the tokens being run.
    """
    _state.positions = positions.tolist()
    try:
        yield
    finally:
        _state.positions = None


def sparse_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of queries at sorted absolute positions over keys ``0..N-1``.

    Args:
        module: The attention module (unused).
        query: ``[batch, heads, queries, dim]``.
        key: ``[batch, kv_heads, N, dim]``.
        value: ``[batch, kv_heads, N, dim]``.
        attention_mask: Ignored; causality comes from the query positions.
        scaling: Softmax scale (default ``dim ** -0.5``).
        dropout: Must be 0 (inference only).
        **kwargs: ``sliding_window`` and ``softcap`` are honoured.

    Returns:
        ``([batch, queries, heads, dim], None)`` like transformers' SDPA function.
    """
    positions = getattr(_state, "positions", None)
    if positions is None or len(positions) != query.shape[2]:
        raise RuntimeError("sparse causal attention used outside query_positions()")
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for start in range(0, len(positions), _QUERY_BLOCK):
        end = min(start + _QUERY_BLOCK, len(positions))
        last = positions[end - 1] + 1
        first_key = max(0, positions[start] - window + 1) if window else 0
        keys = torch.arange(first_key, last, device=query.device)
        block_pos = torch.tensor(positions[start:end], device=query.device).view(-1, 1)
        allowed = keys.view(1, -1) <= block_pos
        if window:
            allowed &= keys.view(1, -1) > block_pos - window
        k = key[:, :, first_key:last]
        v = value[:, :, first_key:last]
        q = query[:, :, start:end]
        if softcap:
            out[:, :, start:end] = _eager_softcap(q, k, v, allowed, scale, softcap, groups)
        else:
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=scale, enable_gqa=groups > 1
            )
    return out.transpose(1, 2).contiguous(), None


def _eager_softcap(q, k, v, allowed, scale: float, softcap: float, groups: int) -> torch.Tensor:
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


AttentionInterface.register(ATTENTION_NAME, sparse_causal_attention)
