"""The blend pass's sparse causal attention equals dense masked attention."""

import pytest
import torch

from kvboost_rag.attention import query_positions, sparse_causal_attention


def dense_reference(q, k, v, positions, window=None, softcap=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(k.shape[2]).view(1, -1)
    pos = positions.view(-1, 1)
    allowed = keys <= pos
    if window:
        allowed &= keys > pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize(("window", "softcap", "kv_heads"), [(None, None, 4), (None, None, 2), (40, None, 2), (None, 30.0, 1)])
def test_sparse_attention_matches_dense(window, softcap, kv_heads):
    torch.manual_seed(0)
    n, queries = 300, 70
    positions = torch.randperm(n)[:queries].sort().values
    q = torch.randn(1, 4, queries, 16)
    k, v = torch.randn(1, kv_heads, n, 16), torch.randn(1, kv_heads, n, 16)
    with query_positions(positions):
        out, _ = sparse_causal_attention(None, q, k, v, None, sliding_window=window, softcap=softcap)
    expected = dense_reference(q, k, v, positions, window, softcap)
    assert torch.allclose(out, expected, atol=1e-5)


def test_sparse_attention_needs_positions():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="query_positions"):
        sparse_causal_attention(None, q, q, q, None)
