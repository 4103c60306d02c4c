"""Attention of a captured step: every row's new tokens over their own slots of the pool.

The model runs one captured step as one sequence of ``tokens`` new tokens (the rows' tokens
end to end, :mod:`kvboost_rag.hf.captured.rows`). Each layer's cache update writes the new
tokens' K/V into the pool at their rows (:class:`PoolCache`: one ``index_copy_`` per K and V
at indexes held on the device) and hands the layer's whole pool to attention;
:func:`rows_attention` then runs one FlexAttention call per layer in which query ``q`` sees
the pool rows ``first_key[q]..pool_row[q]``: its own slot up to its own position, within the
layer's sliding window if it has one. A block mask lists, for the step's queries, the pool
blocks any of them reads (:func:`block_mask`), so a call reads the rows' K/V once and never
the rest of the pool; every shape is fixed by the bucket and the pool, so the step compiles
into one graph and, on CUDA, replays as one CUDA graph.

The masks reach the layers as the model call's ``attention_mask``: a 4-D block mask is passed
through by transformers' mask preparation as it is (:class:`StepMask` holds the global layers'
mask and those of the sliding windows), and every attention layer hands it to its attention
function. The function is registered under :data:`ROWS_ATTENTION` without a mask function, so
transformers builds no mask of its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from kvboost_rag.attention_backends.spec import AttentionSpec
from kvboost_rag.hf.captured.pool import KV_BLOCK, SlotPool

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5: no FlexAttention (missing_support() says so)
    BlockMask, flex_attention = object, None

ROWS_ATTENTION = "kvboost_captured_rows"
#: Queries per block of the block mask (FlexAttention's default block size).
Q_BLOCK = 128


def missing_support() -> str:
    """Why this torch cannot build captured steps; empty when it can (FlexAttention with block
    masks built from block lists alone, torch 2.9 on)."""
    if flex_attention is None or "compute_q_blocks" not in inspect.signature(BlockMask.from_kv_blocks).parameters:
        return f"captured steps need torch>=2.9 (FlexAttention block masks from block lists); this is torch {torch.__version__}"
    return ""


def block_mask(first_key: torch.Tensor, last_key: torch.Tensor, total_tokens: int, window: int | None = None) -> BlockMask:
    """Query ``q`` sees pool rows ``first_key[q]..last_key[q]`` (and, with a ``window``, only
    the last ``window`` of them). The block mask lists the pool blocks any query of each query
    block reads, in order; it is built on the device with fixed shapes (no host read), and its
    mask function reads only ``first_key`` and ``last_key``.

    Args:
        first_key: ``[queries]`` int64, the first pool row each query may read.
        last_key: ``[queries]`` int64, the last (the query's own row).
        total_tokens: Rows of the pool (a whole number of :data:`KV_BLOCK` blocks).
        window: Sliding window of the layers using the mask, or ``None``.
    """
    queries = first_key.shape[0]
    q_blocks = max(1, queries // Q_BLOCK)  # a bucket is under one block or a whole number of blocks
    kv_blocks = total_tokens // KV_BLOCK
    lowest = first_key if window is None else torch.maximum(first_key, last_key - (window - 1))
    starts = torch.arange(kv_blocks, device=first_key.device).view(1, -1) * KV_BLOCK  # [1, kv_blocks]
    reads = (starts <= last_key.view(-1, 1)) & (starts + KV_BLOCK > lowest.view(-1, 1))  # [queries, kv_blocks]
    reads = reads.view(q_blocks, -1, kv_blocks).any(dim=1)  # [q_blocks, kv_blocks]
    count = reads.sum(dim=-1, dtype=torch.int32).view(1, 1, q_blocks)
    # The blocks read first, in increasing order (a stable sort of "not read").
    order = torch.argsort((~reads).to(torch.int8), dim=-1, stable=True).to(torch.int32).view(1, 1, q_blocks, kv_blocks)

    def mask_mod(batch, head, q_idx, kv_idx):
        seen = (kv_idx >= first_key[q_idx]) & (kv_idx <= last_key[q_idx])
        return seen if window is None else seen & (kv_idx > last_key[q_idx] - window)

    return StepMask.from_kv_blocks(
        count, order, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, seq_lengths=(queries, total_tokens),
        compute_q_blocks=False,
    )


class StepMask(BlockMask):
    """The block mask of a step's global layers, holding those of its sliding windows
    (:attr:`windowed`, set by :func:`step_mask`) and, in a step that records attention,
    what to record (:attr:`record`)."""

    windowed: dict[int, BlockMask]
    record: AttentionRecord | None = None

    @property
    def ndim(self) -> int:
        """Dimensions, as a 4-D mask tensor has (some models check a mask's ``ndim``)."""
        return len(self.shape)

    def for_window(self, window: int | None) -> BlockMask:
        """The mask of layers with ``window`` (``None``: global layers).

        Raises:
            RuntimeError: The step built no mask for that window.
        """
        if window is None:
            return self
        mask = getattr(self, "windowed", {}).get(window)
        if mask is None:
            raise RuntimeError(f"captured step built no block mask for sliding window {window}")
        return mask


class AttentionRecord(NamedTuple):
    """What a step records of its attention: per layer, the attention weights of some of its
    queries over the pool, mean over heads, summed over those queries (what the eager probe's
    :func:`~kvboost_rag.attention_backends.sparse.last_query_attention` records over a prompt).

    Attributes:
        weights: ``[layers, pool tokens]`` float32, written by every layer of the step.
        queries: ``[count]`` int64, the queries recorded (indexes on the step's token axis).
        first_key: ``[count]`` int64, the first pool row each of them may read.
        last_key: ``[count]`` int64, the last (its own row).
    """

    weights: torch.Tensor
    queries: torch.Tensor
    first_key: torch.Tensor
    last_key: torch.Tensor


def record_attention(record: AttentionRecord, layer: int, query: torch.Tensor, key: torch.Tensor, spec: AttentionSpec) -> None:
    """Write layer ``layer``'s weights of the recorded queries into ``record.weights``: scores
    in the keys' dtype, then float32 (softcap as the layer applies it), masked to each query's
    rows (and window), softmax over the pool, mean over heads, sum over the queries."""
    window, softcap = spec.window, spec.softcap
    kv_heads = key.shape[1]
    q = query[0][:, record.queries].to(key.dtype)  # [heads, count, dim]
    q = q.view(kv_heads, -1, q.shape[1], q.shape[2])  # [kv_heads, groups, count, dim]
    scores = torch.matmul(q, key[0].transpose(-1, -2).unsqueeze(1)).float() * spec.scale  # [kv_heads, groups, count, pool]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(key.shape[2], device=key.device).view(1, -1)  # [1, pool]
    visible = (rows >= record.first_key.view(-1, 1)) & (rows <= record.last_key.view(-1, 1))  # [count, pool]
    if window:
        visible &= rows > record.last_key.view(-1, 1) - window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1).mean(dim=(0, 1)).sum(dim=0)  # [pool]
    record.weights[layer].copy_(weights)


def step_mask(pool_rows: torch.Tensor, first_key: torch.Tensor, windows: Sequence[int | None], total_tokens: int) -> StepMask:
    """The masks of one step: query ``q`` (at pool row ``pool_rows[q]``) reads its slot from
    ``first_key[q]``; one mask for global layers and one per sliding window in ``windows``."""
    mask = block_mask(first_key, pool_rows, total_tokens)
    mask.windowed = {w: block_mask(first_key, pool_rows, total_tokens, w) for w in windows if w is not None}
    return mask


class PoolLayer(CacheLayerMixin):
    """Layer ``i`` of the pool for one token bucket: writes the step's new K/V at the pool rows
    of the bucket's input table and returns the whole layer (attention reads only the rows each
    query may see).

    Args:
        keys: ``[kv_heads, pool tokens, head_dim]`` view of the pool's keys for this layer.
        values: Same for the values.
        pool_rows: ``[bucket]`` int64 device tensor (fixed address): where each new token's
            K/V goes.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, pool_rows: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.pool_rows = keys, values, pool_rows
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the pool is allocated up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[1, kv_heads, bucket, dim]`` new K/V at the pool rows."""
        self.keys.index_copy_(1, self.pool_rows, key_states[0])
        self.values.index_copy_(1, self.pool_rows, value_states[0])
        return self.keys.unsqueeze(0), self.values.unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[1], 0

    def get_seq_length(self) -> int:
        return 0  # many sequences live here; every step passes its positions explicitly

    def get_max_length(self) -> int:
        return self.keys.shape[1]


class PoolCache(Cache):
    """The pool seen by the model as a cache, for one token bucket (one :class:`PoolLayer` per
    layer).

    Args:
        pool: The slot pool.
        pool_rows: The bucket's ``[bucket]`` pool rows (a row of its input table).
    """

    def __init__(self, pool: SlotPool, pool_rows: torch.Tensor) -> None:
        layers = [PoolLayer(pool.keys[i], pool.values[i], pool_rows) for i in range(pool.keys.shape[0])]
        super().__init__(layers=layers)


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: StepMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One FlexAttention call over the pool for every new token of the step.

    Args:
        module: The attention module (unused).
        query: ``[1, heads, tokens, dim]``.
        key: ``[1, kv_heads, pool tokens, dim]``: the layer's pool (from :class:`PoolLayer`).
        value: Same for values.
        attention_mask: The step's :class:`StepMask`.
        scaling: Softmax scale.
        dropout: Ignored (inference only).
        **kwargs: ``sliding_window`` and ``softcap`` are honoured.

    Returns:
        ``([1, tokens, heads, dim], None)`` like transformers' SDPA function.
    """
    if not isinstance(attention_mask, StepMask):
        raise RuntimeError("captured rows attention used outside a captured step (no step mask)")
    if kwargs.get("s_aux") is not None:  # attention sinks: not computed here, so no step is built
        raise RuntimeError("captured rows attention has no attention sinks")
    mask = attention_mask.for_window(kwargs.get("sliding_window") or None)
    softcap = kwargs.get("softcap") or None
    score_mod = None
    if softcap:

        def score_mod(score, batch, head, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap

    # Several queries of a step read different rows: flex-decoding, the kernel inductor picks
    # for short query lengths, gave wrong rows for steps of more than one token on an H100
    # (one token: right), so those steps use the main FlexAttention kernel.
    record = attention_mask.record
    if record is not None:
        record_attention(record, module.layer_idx, query, key, AttentionSpec.of_call(query, scaling, kwargs))
    options = {"FORCE_USE_FLEX_ATTENTION": True} if query.shape[2] > 1 else None
    out = flex_attention(
        query, key, value, score_mod=score_mod, block_mask=mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], kernel_options=options,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ROWS_ATTENTION, rows_attention)  # no mask function: transformers builds no mask
