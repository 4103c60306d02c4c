"""Attention kernels for short rows: a few new tokens at the end of their own K/V.

A decode step feeds each running sequence one token; a verify step the pending token and its
drafts. In the engine loop's packed pass (:mod:`kvboost_rag.hf.packed`) each such row is a
segment whose new tokens are the last keys of its own cache. Two kernels serve them better than
the general attention by blocks of queries:

- :func:`last_tokens_attention`: a row's few tokens over its keys as one product per K/V head
  (a CPU in float32: SDPA's kernels run a few queries of a grouped-query model one head and
  token block at a time);
- :func:`in_one_call`: many rows in one SDPA call, their K/V padded to the longest row and
  masked (CUDA: one kernel instead of one per row, while the padding copies little;
  :func:`one_call` overrides the choice).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kvboost_rag.hf.sparse_attention import thread_setting
from kvboost_rag.hf.transfer import host_to_device

#: Most padded K/V rows (rows x longest sequence) a one-call step copies per layer; beyond it
#: the rows are attended one by one (a kernel per row instead of a copy of every row's K/V).
ONE_CALL_MAX_TOKENS = 16384
_state = threading.local()


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


def in_one_call(
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


def one_call_setting() -> bool | None:
    """What :func:`one_call` set in this thread (``None``: the default)."""
    return getattr(_state, "one_call", None)
