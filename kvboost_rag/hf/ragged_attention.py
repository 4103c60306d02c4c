"""One decode step for several sequences of different lengths, each over its own cache.

Batched decoding feeds each sequence's new tokens through the model in one forward pass (one
token per row in a plain step; the pending token and its drafts in a verify step, rows padded
to one width): the projections, MLPs and logits run as one ``[batch, tokens, hidden]`` batch,
while attention runs row by row, each row's queries over that row's own K/V. Padded tokens are
neither stored nor attended to, and no K/V is copied into a shared batch tensor: every sequence
keeps the
:class:`~kvboost_rag.hf.caches.BufferedCache` its prefill built (with room reserved for its
new tokens), so a sequence joins or leaves the batch between two steps at no cost.

:class:`~kvboost_rag.hf.caches.RaggedCache` is the cache handed to the model: its layer ``i`` appends row ``b``'s new
K/V to sequence ``b``'s layer ``i`` and leaves the per-row K/V where the attention function
registered by :mod:`kvboost_rag.hf.attention_switch` (:data:`RAGGED_ATTENTION`, active while the model's attention implementation
is switched to it) reads them. Each new token attends causally up to its own position, within
the layer's sliding window if it has one, with softcapping where the model applies it, as in
:mod:`kvboost_rag.hf.sparse_attention`'s block loop, so a row sees exactly what a one-sequence
step sees.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kvboost_rag.hf.sparse_attention import attend_blocks, thread_setting
from kvboost_rag.hf.transfer import host_to_device

RAGGED_ATTENTION = "kvboost_ragged_decode"
#: Most padded K/V rows (rows x longest sequence) a one-call step copies per layer; beyond it
#: the rows are attended one by one (a kernel per row instead of a copy of every row's K/V).
ONE_CALL_MAX_TOKENS = 16384
_state = threading.local()


def ragged_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of each row's new tokens over that row's own K/V (left by :func:`set_rows`).

    Args:
        module: The attention module (unused).
        query: ``[batch, heads, tokens, dim]``: each row's new tokens (a decode step: one; a
            verify step: the pending token and its drafts, rows padded to one width).
        key: The new keys only (the rows' whole K/V come from the cache's update).
        value: The new values only.
        attention_mask: Ignored; a row's new tokens are its last keys, and each attends to the
            keys up to its own position.
        scaling: Softmax scale (default ``dim ** -0.5``).
        dropout: Must be 0 (inference only).
        **kwargs: ``sliding_window`` and ``softcap`` are honoured.

    Returns:
        ``([batch, tokens, heads, dim], None)`` like transformers' SDPA function; a padded
        token's output is zero.
    """
    rows = getattr(_state, "rows", None)
    if rows is None or len(rows[0]) != query.shape[0]:
        raise RuntimeError("ragged decode attention used outside a RaggedCache decode step")
    keys, values, counts = rows
    _state.rows = None
    _state.calls = getattr(_state, "calls", 0) + 1
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // keys[0].shape[1]
    width = query.shape[2]
    counts = counts or [width] * len(keys)
    one_call = getattr(_state, "one_call", None)
    if one_call is None:  # by default: on CUDA, when padding copies little
        one_call = query.device.type == "cuda" and len(keys) * max(k.shape[-2] for k in keys) <= ONE_CALL_MAX_TOKENS
    if softcap is None and one_call and len(keys) > 1:
        out = _in_one_call(query, keys, values, counts, scale, window, groups)
        return out.transpose(1, 2).contiguous(), None
    out = torch.zeros_like(query) if min(counts) < width else torch.empty_like(query)
    for b, (k, v) in enumerate(zip(keys, values)):
        real = counts[b]
        q = query[b : b + 1, :, :real]
        every_key = softcap is None and (window is None or window >= k.shape[-2])
        if real == 1 and window is None and softcap is None:  # the last position: every key is visible
            out[b : b + 1, :, :1] = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=groups > 1)
        elif every_key and query.device.type == "cpu" and query.dtype == torch.float32:  # a verify row
            out[b : b + 1, :, :real] = last_tokens_attention(q, k, v, scale)
        else:  # a row's real tokens are its last keys; their positions are made on the device (no copy)
            length = k.shape[-2]
            on_device = torch.arange(length - real, length, device=query.device)
            positions = list(range(length - real, length))
            out[b : b + 1, :, :real] = attend_blocks(q, k, v, positions, scale, window, softcap, on_device)
    return out.transpose(1, 2).contiguous(), None


def last_tokens_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a row's new tokens, which are its last keys, each over the keys up to its
    own position, with no window or softcap: one product of all queries of a K/V head (the
    heads that share it and the tokens, ``groups x tokens`` rows) with its keys, a softmax in
    float32 with the tokens' causal corner masked, one product with its values. SDPA's
    kernels on a CPU run a few queries of a grouped-query model one head and token block at
    a time, over K/V expanded per head: 8 tokens cost 3-4x one there, 2-3x here (the
    arithmetic itself grows with the tokens).

    Args:
        query: ``[1, heads, tokens, dim]``.
        key: ``[1, kv_heads, length, dim]`` (the new tokens' keys last).
        value: ``[1, kv_heads, length, dim]``.
        scale: Softmax scale.

    Returns:
        ``[1, heads, tokens, dim]``.
    """
    _, heads, tokens, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    folded = query.reshape(kv_heads, groups * tokens, dim)  # head h = kv * groups + g: rows g * tokens + t
    scores = torch.matmul(folded, key[0].transpose(-1, -2)).float()  # [kv_heads, groups * tokens, length]
    scores.mul_(scale)
    if tokens > 1:  # token t sees the new keys up to its own: the strict upper corner is masked
        scores.view(kv_heads, groups, tokens, length)[..., length - tokens + 1 :].add_(_corner(tokens, scores.device))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value[0]).view(1, heads, tokens, value.shape[-1])


_corners: dict[tuple[int, str], torch.Tensor] = {}


def _corner(tokens: int, device: torch.device) -> torch.Tensor:
    """``[tokens, tokens - 1]``: ``-inf`` where token ``t`` would see a later new token."""
    key = (tokens, str(device))
    corner = _corners.get(key)
    if corner is None:
        later = torch.ones(tokens, tokens - 1, dtype=torch.bool).triu()  # column c is new key c + 1
        corner = torch.zeros(tokens, tokens - 1).masked_fill(later, float("-inf")).to(device)
        _corners[key] = corner
    return corner


def _in_one_call(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    counts: list[int],
    scale: float,
    window: int | None,
    groups: int,
) -> torch.Tensor:
    """Every row's attention in one SDPA call: the rows' K/V padded to the longest, each new
    token masked to its row's keys up to its own position (and window). Row lengths are
    shapes, read on the host: no sync. A padded token attends like its row's last real one."""
    lengths = [k.shape[-2] for k in keys]
    longest = max(lengths)
    batch, kv_heads, dim = len(keys), keys[0].shape[1], keys[0].shape[-1]
    width = query.shape[2]
    padded_keys = query.new_zeros((batch, kv_heads, longest, dim))
    padded_values = query.new_zeros((batch, kv_heads, longest, values[0].shape[-1]))
    for b, (k, v) in enumerate(zip(keys, values)):
        padded_keys[b, :, : lengths[b]] = k[0]
        padded_values[b, :, : lengths[b]] = v[0]
    # Position of each new token: a row's real tokens are its last keys.
    ends = [[lengths[b] - counts[b] + min(t, counts[b] - 1) + 1 for t in range(width)] for b in range(batch)]
    index = torch.arange(longest, device=query.device).view(1, 1, -1)
    end = host_to_device(torch.tensor(ends), query.device).view(batch, width, 1)
    visible = index < end
    if window is not None:
        visible &= index >= end - window
    mask = visible.view(batch, 1, width, longest)
    return F.scaled_dot_product_attention(
        query, padded_keys, padded_values, attn_mask=mask, scale=scale, enable_gqa=groups > 1
    )


@contextlib.contextmanager
def one_call(enabled: bool) -> Iterator[None]:
    """Within the block (this thread), batched decode steps of several rows compute every
    row's attention in one call (``True``) or one call per row (``False``); by default one
    call on CUDA while the padded K/V stays under :data:`ONE_CALL_MAX_TOKENS` rows, per row
    elsewhere (the per-row calls copy nothing; one row is always attended directly)."""
    with thread_setting(_state, "one_call", enabled):
        yield


def set_rows(keys: list[torch.Tensor], values: list[torch.Tensor], counts: list[int] | None = None) -> None:
    """Hand every row's whole K/V of the layer being run, and how many of the step's new
    tokens of each row are real (``None``: all), to the next attention call."""
    _state.rows = (keys, values, counts)


def attention_calls() -> int:
    """Calls of :func:`ragged_decode_attention` in this thread so far (a model whose attention
    does not go through transformers' attention interface never calls it)."""
    return getattr(_state, "calls", 0)

