"""The blend pass's sparse causal attention equals dense masked attention, on the CPU and on
CUDA (where ``flex`` runs compiled); the dense reference is computed on the CPU."""


import pytest
import torch
from rag_prompts import rag_prompt

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.attention_backends.sparse import (
    BACKENDS,
    default_backend,
    last_query_attention,
    query_positions,
    sparse_causal_attention,
    use_backend,
)


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


def sparse_on(device: str, positions, *tensors, **kwargs) -> torch.Tensor:
    """Sparse causal attention over CPU-made ``tensors`` (query, key, value) run on ``device``
    (positions stay on the host, as the engine passes them); the output on the CPU."""
    q, k, v = (t.to(device) for t in tensors)
    with query_positions(positions, torch.device(device)):
        out, _ = sparse_causal_attention(None, q, k, v, None, **kwargs)
    return out.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("window", "softcap", "kv_heads"), [(None, None, 4), (None, None, 2), (40, None, 2), (None, 30.0, 1)])
def test_sparse_attention_matches_dense(backend, window, softcap, kv_heads, device):
    torch.manual_seed(0)
    n, queries = 300, 70
    positions = torch.randperm(n)[:queries].sort().values
    q = torch.randn(1, 4, queries, 16)
    k, v = torch.randn(1, kv_heads, n, 16), torch.randn(1, kv_heads, n, 16)
    with use_backend(backend):
        out = sparse_on(device, positions, q, k, v, sliding_window=window, softcap=softcap)
    expected = dense_reference(q, k, v, positions, window, softcap)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contiguous_queries_on_top_of_a_prefix(backend, device):
    """A prefix hit runs positions h..n-1 on top of h cached tokens: causal with an offset."""
    torch.manual_seed(1)
    n, h = 200, 130
    positions = torch.arange(h, n)
    q = torch.randn(1, 4, n - h, 16)
    k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    with use_backend(backend):
        out = sparse_on(device, positions, q, k, v)
    assert torch.allclose(out, dense_reference(q, k, v, positions), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_in_bfloat16(backend, device):
    torch.manual_seed(2)
    n, queries = 256, 40
    positions = torch.randperm(n)[:queries].sort().values
    q = torch.randn(1, 4, queries, 16)
    k, v = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    with use_backend(backend):
        out = sparse_on(device, positions, q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), dense_reference(q, k, v, positions), atol=3e-2)


def test_default_backend_on_cpu_is_the_block_loop_for_scattered_queries_and_one_call_for_a_chunk():
    assert default_backend(torch.device("cpu")) == "blocks"
    assert default_backend(torch.device("cpu"), contiguous=True) == "masked_sdpa"


@pytest.mark.cuda
def test_default_backend_on_cuda_is_compiled_flex_attention():
    from kvboost_rag.attention_backends import sparse as attention

    assert default_backend(torch.device("cuda")) == "flex" and attention._flex_uses_compiled(torch.device("cuda"))


def test_unknown_backend_is_rejected():
    with pytest.raises(InvalidInputError, match="masked_sdpa"), use_backend("loop"):
        pass


def test_sparse_attention_needs_positions():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="query_positions"):
        sparse_causal_attention(None, q, q, q, None)


def test_failed_flex_compilation_falls_back_to_one_masked_call(monkeypatch, caplog):
    """A compiled kernel that cannot be built for some inputs: those calls (and later calls with
    inputs of the same kind) are answered by one masked SDPA call, correctly; the backend stays
    FlexAttention for other kinds of input."""
    from kvboost_rag.attention_backends import sparse as attention

    eager, _, create_block_mask = attention._flex_functions()

    def broken(*args, **kwargs):
        raise RuntimeError("no triton")

    monkeypatch.setattr(attention, "_flex_functions", lambda backend="inductor": (eager, broken, create_block_mask))
    monkeypatch.setattr(attention, "_flex_failed", set())
    torch.manual_seed(3)
    positions = torch.tensor([3, 9, 10, 40])
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    monkeypatch.setattr(attention, "_flex_uses_compiled", lambda device: True)  # as on a GPU
    for _ in range(2):
        with use_backend("flex"), query_positions(positions), caplog.at_level("WARNING"):
            out, _ = sparse_causal_attention(None, q, k, v, None)
        assert torch.allclose(out, dense_reference(q, k, v, positions), atol=1e-5)
    assert caplog.text.count("compiled FlexAttention failed") == 1
    assert attention.flex_failures() == {(torch.float32, 8, 1, False, False, "cpu")}
    assert attention.default_backend(torch.device("cuda")) == "flex"


@pytest.mark.cuda
def test_compiled_flex_attention_builds_for_real_model_heads():
    """bfloat16 with 64- and 128-wide heads and grouped queries (the shapes of 7-8B models and
    SmolLM2): compiled FlexAttention runs (no fall-back recorded) and matches dense attention
    within bfloat16's rounding."""
    from kvboost_rag.attention_backends import sparse as attention

    torch.manual_seed(0)
    for head_dim, heads, kv_heads in ((128, 32, 8), (64, 9, 3)):
        positions = torch.randperm(700)[:130].sort().values
        q = torch.randn(1, heads, 130, head_dim)
        k, v = torch.randn(1, kv_heads, 700, head_dim), torch.randn(1, kv_heads, 700, head_dim)
        with use_backend("flex"):
            out = sparse_on("cuda", positions, q.bfloat16(), k.bfloat16(), v.bfloat16())
        signature = (torch.bfloat16, head_dim, heads // kv_heads, False, False, "cuda")
        assert signature not in attention.flex_failures()
        expected = dense_reference(q, k, v, positions)
        assert torch.allclose(out.float(), expected, atol=0.05), float((out.float() - expected).abs().max())


def dense_last_query_weights(q, k, position, window=None, softcap=None):
    """Softmax weights of the last query over the keys it sees, mean over heads."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    scores = q[:, :, -1:] @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # [1, heads, 1, keys]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(k.shape[2])
    allowed = keys <= position
    if window:
        allowed &= keys > position - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1).mean(dim=(0, 1, 2))


@pytest.mark.parametrize(("window", "softcap", "kv_heads"), [(None, None, 4), (None, None, 2), (40, None, 2), (None, 30.0, 1)])
def test_last_query_attention_records_the_last_querys_weights(window, softcap, kv_heads, device):
    torch.manual_seed(2)
    n, queries = 300, 50
    positions = torch.randperm(n - 20)[:queries].sort().values  # the last query sits before the last key
    q_host = torch.randn(1, 4, queries, 16)
    k_host = torch.randn(1, kv_heads, n, 16)
    q, k, v = q_host.to(device), k_host.to(device), torch.randn(1, kv_heads, n, 16).to(device)
    with query_positions(positions, torch.device(device)):
        plain, _ = sparse_causal_attention(None, q, k, v, None, sliding_window=window, softcap=softcap)
        with last_query_attention() as recorded:
            out, _ = sparse_causal_attention(None, q, k, v, None, sliding_window=window, softcap=softcap)
            sparse_causal_attention(None, q, k, v, None, sliding_window=window, softcap=softcap)
        sparse_causal_attention(None, q, k, v, None, sliding_window=window, softcap=softcap)
    assert len(recorded) == 2  # one per call inside the block, none after it
    assert torch.equal(out, plain)  # recording leaves the attention output alone
    expected = dense_last_query_weights(q_host, k_host, int(positions[-1]), window, softcap)
    assert recorded[0].shape == (n,) and recorded[0].device == q.device
    assert torch.allclose(recorded[0].cpu(), expected, atol=1e-6)
    assert recorded[0].sum().item() == pytest.approx(1.0, abs=1e-5)
    assert recorded[0][int(positions[-1]) + 1 :].abs().max() == 0


def test_model_whose_attention_cannot_be_recorded_is_repaired_by_cacheblend_and_says_so(
    make_engine, docs, monkeypatch, caplog
):
    import contextlib

    from kvboost_rag.hf import probes

    @contextlib.contextmanager
    def nothing_recorded():
        yield []

    monkeypatch.setattr(probes, "last_query_attention", nothing_recorded)
    engine = make_engine("llama")
    assert not engine._adapter.features.records_attention
    engine.warm_documents(docs[:3])
    with caplog.at_level("WARNING", logger="kvboost_rag"):
        result = engine.generate(rag_prompt(docs[2::-1]), max_new_tokens=2)
    assert "repairing documents with CacheBlend" in caplog.text
    assert result.content_hit_tokens > 0 and result.recomputed_tokens > 0
    assert result.strategy == "cacheblend"


@pytest.mark.parametrize(("window", "kv_heads"), [(None, 2), (40, 1)])
def test_last_query_attention_sums_the_weights_of_the_last_queries(window, kv_heads, device):
    torch.manual_seed(3)
    n, queries, recorded_queries = 200, 30, 5
    positions = torch.randperm(n - 10)[:queries].sort().values
    q = torch.randn(1, 4, queries, 16)
    k, v = torch.randn(1, kv_heads, n, 16), torch.randn(1, kv_heads, n, 16)
    with (
        query_positions(positions, torch.device(device)),
        last_query_attention(queries=recorded_queries) as recorded,
    ):
        sparse_causal_attention(None, q.to(device), k.to(device), v.to(device), None, sliding_window=window)
    expected = sum(
        dense_last_query_weights(q[:, :, : queries - i], k, int(positions[queries - 1 - i]), window)
        for i in range(recorded_queries)
    )
    assert torch.allclose(recorded[0].cpu(), expected, atol=1e-5)
    assert recorded[0].sum().item() == pytest.approx(recorded_queries, abs=1e-4)
