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

from kvboost_rag.attention_backends.spec import AttentionSpec
from kvboost_rag.attention_backends.row_rounding import product, rows_rounding_alike
from kvboost_rag.thread_state import thread_setting
from kvboost_rag.transfer import host_to_device

#: Most padded K/V rows (rows x longest sequence) a one-call step copies per layer; beyond it
#: the rows are attended one by one (a kernel per row instead of a copy of every row's K/V).
ONE_CALL_MAX_TOKENS = 16384
#: Whether a step's rows attend in one call (``one_call``), set around a pass. Thread-local
#: because transformers calls the registered attention function with its own arguments: a
#: per-pass choice reaches it only as ambient state, and a pass on another thread (a second
#: engine, a test) must not see this one's.
_state = threading.local()


def last_tokens_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a row's new tokens, which are its last keys, each over the keys up to its
    own position, with no window or softcap: one product of all queries of a K/V head (the
    heads that share it and the tokens, ``groups x tokens`` rows) with its keys, a softmax in
    float32 with the tokens' causal corner masked, and the products with the values split at a
    fixed key (:func:`_weighted_values`) so that a token's output is bitwise the same in a
    verify step of any length as in a one-token step at its position (the tokens of a row
    shorter than :data:`TOGETHER_MIN_KEYS` keys attend one by one). SDPA's kernels on a CPU
    run a few queries of a grouped-query model one head and token block at a time, over K/V
    expanded per head: 8 tokens cost 3-4x one there, 2-3x here (the arithmetic itself grows
    with the tokens).

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
    fewest_rows = rows_rounding_alike(dim, value.shape[-1])
    if 1 < tokens and (length - tokens + 1 < TOGETHER_MIN_KEYS or fewest_rows is None):  # each token alone
        alone = []
        for t in range(tokens):
            seen = length - tokens + 1 + t
            alone.append(last_tokens_attention(query[:, :, t : t + 1], key[:, :, :seen], value[:, :, :seen], scale))
        return torch.cat(alone, dim=2)
    fewest_rows = fewest_rows or 1
    if tokens == 1:
        return _one_token_attention(query, key, value, scale, fewest_rows)
    groups = heads // kv_heads
    folded = query.reshape(kv_heads, groups * tokens, dim)  # head h = kv * groups + g: rows g * tokens + t
    scores = product(folded, key[0].transpose(-1, -2), fewest_rows).float()  # [kv_heads, groups * tokens, length]
    scores.mul_(scale)
    if tokens > 1:  # token t sees the new keys up to its own: the strict upper corner is masked
        scores.view(kv_heads, groups, tokens, length)[..., length - tokens + 1 :].add_(_corner(tokens, scores.device))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = _weighted_values(probs.view(kv_heads, groups, tokens, length), value[0], fewest_rows)
    return out.view(1, heads, tokens, value.shape[-1])


def _one_token_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, fewest_rows: int) -> torch.Tensor:
    """:func:`last_tokens_attention` of one token, the same products in fewer operations: the
    query's rows padded once to ``fewest_rows`` ride through the softmax and the values'
    product up to the key where a verify step's products split (:func:`_weighted_values`), and
    the keys past it are summed over the token's own rows, as a verify step sums them."""
    _, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    rows = heads // kv_heads
    folded = query.reshape(kv_heads, rows, dim)
    if rows < fewest_rows:
        folded = F.pad(folded, (0, 0, 0, fewest_rows - rows))  # [kv_heads, fewest_rows, dim]
    scores = torch.matmul(folded, key[0].transpose(-1, -2)).float()  # [kv_heads, rows (padded), length]
    scores.mul_(scale)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    anchor = SPLIT_KEYS * (length // SPLIT_KEYS)
    values = value[0]  # [kv_heads, length, dim]
    out = torch.matmul(probs[..., :anchor], values[:, :anchor])[:, :rows]  # zeros over no keys
    if length > anchor:
        out = out + torch.matmul(probs[:, :rows, anchor:], values[:, anchor:])
    return out.reshape(1, heads, 1, value.shape[-1])


#: Fewest keys the first token of a step must see for its tokens to attend together: below it
#: each token attends alone. Torch's CPU softmax sums a row in vector lanes (masked keys add zeros
#: to the same lanes) and MKL's products round alike whatever the count of keys (and of rows,
#: from :func:`~kvboost_rag.attention_backends.row_rounding.rows_rounding_alike`'s count), but not for rows
#: shorter than a vector or two (16 floats with AVX-512), summed another way.
TOGETHER_MIN_KEYS = 64


#: Keys per block of the split value products: a token that sees ``n`` keys sums the first
#: ``SPLIT_KEYS * (n // SPLIT_KEYS)`` of them in one product, the rest in a second one.
SPLIT_KEYS = 64


def _weighted_values(probs: torch.Tensor, values: torch.Tensor, fewest_rows: int) -> torch.Tensor:
    """``probs @ values`` per token, ``[kv_heads, groups, tokens, dim]``, computed so that a
    token's result depends only on its own position, not on the other tokens of the step.

    A product's rounding depends on how many keys it sums (a verify step's first token, its
    later keys masked to zero, summed over more keys than the same token alone: up to 0.8 in
    a logit after int8 activations), and on some CPUs on how many rows it computes (MKL on an
    AMD EPYC sums 1-3 rows another way than 4 or more): products of fewer rows than
    :func:`~kvboost_rag.attention_backends.row_rounding.rows_rounding_alike` measures are padded to it. So a token that sees ``n`` keys sums the first
    ``a = SPLIT_KEYS * (n // SPLIT_KEYS)`` in one product over exactly ``a`` keys, shared by the
    step's tokens with the same ``a``, and adds its last ``n - a`` keys' product, one per token.

    Args:
        probs: ``[kv_heads, groups, tokens, length]`` attention weights; token ``t`` sees keys
            up to ``length - tokens + t`` (the later ones' weights are zero).
        values: ``[kv_heads, length, dim]``.
        fewest_rows: Rows the shared product is padded to (:func:`rows_rounding_alike`).
    """
    kv_heads, groups, tokens, length = probs.shape
    seen = [length - tokens + 1 + t for t in range(tokens)]
    anchors = [SPLIT_KEYS * (n // SPLIT_KEYS) for n in seen]
    folded = probs.view(kv_heads, groups * tokens, length)
    out = None
    for anchor in sorted(set(anchors)):  # one for a step of one; two where the tokens straddle a split
        head = product(folded[..., :anchor], values[:, :anchor], fewest_rows).view(kv_heads, groups, tokens, -1)  # zeros over no keys
        first = anchors.index(anchor)  # the tokens from here on split there
        if out is None:
            out = head
        else:
            out[:, :, first:] = head[:, :, first:]
    for t in range(tokens):
        if seen[t] > anchors[t]:
            out[:, :, t] += torch.matmul(probs[:, :, t, anchors[t] : seen[t]], values[:, anchors[t] : seen[t]])
    return out


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
    spec: AttentionSpec,
    groups: int,
) -> torch.Tensor:
    """Every row's attention in one SDPA call: the rows' K/V padded to the longest, each new
    token masked to its row's keys up to its own position (and ``spec``'s window; no softcap).
    Row lengths are shapes, read on the host: no sync. A padded token attends like its row's
    last real one."""
    if spec.softcap is not None:
        raise ValueError("rows attended in one call take no softcap")
    window = spec.window
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
        query, padded_keys, padded_values, attn_mask=mask, scale=spec.scale, enable_gqa=groups > 1
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
