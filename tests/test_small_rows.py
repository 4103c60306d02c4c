"""The decode and verify steps' kernels for a few rows: the linear layers' (oneDNN over packed
or own weights, chosen at load; the int8 copy: tests/test_int8_decode.py) and the attention of
a row's last tokens.

Whatever kernel runs, a step must compute what the model's own layers compute, to float32
rounding, and nothing outside the engine's steps may see a difference: prefill passes and the
user's own calls of the model keep ``F.linear`` over the model's own weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.decode_weights import small_rows
from kvboost_rag.attention_backends import ragged as ragged_attention, row_rounding
from kvboost_rag.attention_backends.ragged import last_tokens_attention
from kvboost_rag.decode_weights.small_rows import SmallRowLinears, choose_kernel, eligible_linears

needs_onednn = pytest.mark.skipif(not small_rows.onednn_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("kernel", ["packed", "onednn"])
def test_a_chosen_kernel_computes_the_layers_results_only_inside_steps(kernel):
    model = tiny_model("qwen2")  # biased projections, a tied output layer
    layers = eligible_linears(model)
    assert model.lm_head in layers and len(layers) == len(list(m for m in model.modules() if isinstance(m, torch.nn.Linear)))
    chosen = choose_kernel(model, kernel, packed_bytes=2**30)
    assert chosen.kernel == kernel and set(chosen.weights) == set(layers)
    for layer in (layers[0], model.lm_head):
        for rows in (1, 3, 8, 16):
            x = torch.randn(2, rows, layer.in_features)
            expected = F.linear(x, layer.weight, layer.bias)
            assert torch.equal(layer(x), expected)  # outside a step: the model's own product
            with torch.inference_mode(), chosen.active():
                torch.testing.assert_close(chosen.in_view(layer)(x), expected, rtol=1e-5, atol=1e-5)
                assert torch.equal(layer(x), expected)  # the model's own module: never routed
        wide = torch.randn(small_rows.MAX_ROWS + 1, layer.in_features)
        with torch.inference_mode(), chosen.active():  # beyond MAX_ROWS (a prefill): the model's own
            assert torch.equal(chosen.in_view(layer)(wide), F.linear(wide, layer.weight, layer.bias))
    chosen.restore()
    assert all("forward" not in layer.__dict__ for layer in layers) and chosen.kernel == "off"


@needs_onednn
def test_packed_copies_stay_within_their_budget_and_the_own_weights_serve_instead():
    model = tiny_model("llama")
    weight_bytes = sum(layer.weight.numel() * 4 for layer in eligible_linears(model))
    assert choose_kernel(model, "packed", packed_bytes=weight_bytes - 1).kernel == "off"
    own = choose_kernel(model, "onednn", packed_bytes=0)
    assert own.kernel == "onednn" and own.copy_bytes == 0
    assert all(weight is layer.weight.detach() or weight.data_ptr() == layer.weight.data_ptr() for layer, weight in own.weights.items())


def test_layers_the_kernels_cannot_take_keep_their_own_product():
    assert eligible_linears(tiny_model("llama", dtype=torch.bfloat16)) == []
    model = tiny_model("llama")

    class Subclass(torch.nn.Linear):  # a quantized or adapter layer: its own forward
        pass

    model.lm_head.__class__ = Subclass
    model.model.layers[0].mlp.up_proj.forward = lambda x: x  # another library's hook
    layers = eligible_linears(model)
    assert model.lm_head not in layers and model.model.layers[0].mlp.up_proj not in layers and layers
    assert choose_kernel(model, "off", packed_bytes=2**30).kernel == "off"


@needs_onednn
def test_auto_packs_only_layers_large_enough_and_within_the_budget(monkeypatch):
    """``"auto"`` is a rule, nothing timed: the packed copy where the layers' weights reach
    :data:`~kvboost_rag.decode_weights.small_rows.PACKED_MIN_BYTES` and the copy fits its budget."""
    model = tiny_model("llama")
    weight_bytes = sum(layer.weight.numel() * 4 for layer in eligible_linears(model))
    assert weight_bytes < small_rows.PACKED_MIN_BYTES
    assert choose_kernel(model, "auto", packed_bytes=2**30).kernel == "off"  # tiny layers: F.linear
    monkeypatch.setattr(small_rows, "PACKED_MIN_BYTES", weight_bytes)
    packed = choose_kernel(model, "auto", packed_bytes=weight_bytes)
    assert packed.kernel == "packed" and packed.copy_bytes >= weight_bytes
    packed.restore()
    assert choose_kernel(model, "auto", packed_bytes=weight_bytes - 1).kernel == "off"
    assert all("forward" not in layer.__dict__ for layer in eligible_linears(model))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
def test_the_last_tokens_attention_equals_masked_sdpa(heads, kv_heads, tokens):
    torch.manual_seed(tokens)
    length, dim = 37, 16
    query = torch.randn(1, tokens, heads, dim).transpose(1, 2)  # as attention layers hand it over
    key, value = torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
    positions = torch.arange(length - tokens, length).view(-1, 1)
    allowed = torch.arange(length).view(1, -1) <= positions
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.3, enable_gqa=heads > kv_heads)
    torch.testing.assert_close(last_tokens_attention(query, key, value, 0.3), expected, rtol=1e-5, atol=1e-5)


def test_an_engine_chooses_once_at_load_and_the_users_model_calls_stay_its_own(make_engine, docs):
    engine = make_engine("llama", small_row_kernels="packed" if small_rows.onednn_available() else "off")
    adapter = engine._adapter
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        before = engine.model(ids).logits
        engine.generate(docs[0] + "\nQuestion: what?\nAnswer:", max_new_tokens=4)
        assert torch.equal(engine.model(ids).logits, before)  # outside a step: untouched
    expected = "packed" if small_rows.onednn_available() else "off"
    assert adapter.small_rows.kernel == engine.small_row_kernel == expected
    assert isinstance(adapter.small_rows, SmallRowLinears)


def test_the_cpu_vendor_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n")
    assert small_rows.cpu_vendor(str(info)) == "GenuineIntel"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert small_rows.cpu_vendor(str(info)) == "AuthenticAMD"
    assert small_rows.cpu_vendor(str(tmp_path / "none")) == ""
    assert small_rows.float_kernel_min_rows("GenuineIntel") == small_rows.OWN_PRODUCT_ROWS_ON_INTEL + 1
    assert small_rows.float_kernel_min_rows("AuthenticAMD") == small_rows.float_kernel_min_rows("") == 1


@needs_onednn
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_on_intel_the_fewest_rows_keep_the_own_product(monkeypatch, vendor):
    monkeypatch.setattr(small_rows, "cpu_vendor", lambda cpuinfo="": vendor)
    model = tiny_model("llama")
    chosen = choose_kernel(model, "packed", packed_bytes=2**30)
    fewest = small_rows.OWN_PRODUCT_ROWS_ON_INTEL + 1 if vendor == "GenuineIntel" else 1
    assert chosen.kernel == "packed" and chosen.min_rows == fewest
    layer = model.lm_head
    kernel = chosen.product(layer)
    with torch.inference_mode(), chosen.active():
        for rows in (1, 2, 3, 8):
            x = torch.randn(rows, layer.in_features)
            expected = kernel(x) if rows >= fewest else F.linear(x, layer.weight, layer.bias)
            assert torch.equal(chosen.in_view(layer)(x), expected)
    int8 = choose_kernel(model, "off", packed_bytes=0, decode_weights="int8")
    assert int8.min_rows == 1  # the int8 copy serves every row count
    chosen.restore()
    int8.restore()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (6, 1)])
@pytest.mark.parametrize("length", [20, 64, 70, 130, 2100])
def test_a_verify_steps_tokens_attend_bitwise_as_one_token_steps(heads, kv_heads, length):
    """A token's attention output must not depend on the other tokens of its step (a float
    product's rounding follows how many keys it sums), so drafts never change greedy tokens."""
    torch.manual_seed(length)
    tokens, dim = 16, 32
    query = torch.randn(1, tokens, heads, dim).transpose(1, 2)
    buffers = torch.full((2, 1, kv_heads, length + 8, dim), float("nan"))  # never read past the keys held
    buffers[:, :, :, :length] = torch.randn(2, 1, kv_heads, length, dim)
    key, value = buffers[0, :, :, :length], buffers[1, :, :, :length]
    together = last_tokens_attention(query, key, value, 0.3)
    assert not together.isnan().any()
    for t in range(tokens):
        seen = length - tokens + 1 + t
        alone = last_tokens_attention(query[:, :, t : t + 1], key[:, :, :seen], value[:, :, :seen], 0.3)
        assert torch.equal(together[:, :, t : t + 1], alone), t


def test_products_padded_to_the_measured_rows_round_each_row_alike_at_any_count():
    """The measured threshold holds on shapes it did not probe: every count of rows, padded to
    it, at any place, rounds bitwise as the same rows of a long product; where none was found,
    some count really rounds another way."""
    fewest = row_rounding.rows_rounding_alike(48, 40)
    generator = torch.Generator().manual_seed(7)
    left, right = torch.randn(2, 70, 1500, generator=generator), torch.randn(2, 1500, 40, generator=generator)
    whole = torch.matmul(left, right)
    if fewest is None:  # e.g. MKL_CBWR=COMPATIBLE: rows round by their place in 4-row blocks
        assert not all(torch.equal(torch.matmul(left[:, :m], right), whole[:, :m]) for m in range(1, 65))
        return
    for m in range(1, 33):
        for offset in (0, 2, 5):
            part = row_rounding.product(left[:, offset : offset + m], right, fewest)
            assert part.shape == (2, m, 40) and part.is_contiguous()
            assert torch.equal(part, whole[:, offset : offset + m]), (m, offset)


@pytest.mark.parametrize("padded", [False, True])
def test_a_verify_step_attends_as_one_token_steps_with_no_threshold_or_past_its_rows(monkeypatch, padded):
    """With no threshold (each token alone), or products padded past the step's rows (from at
    least this CPU's own threshold), the tokens still attend as masked SDPA does and bitwise as
    one-token steps."""
    measured = row_rounding.rows_rounding_alike(16, 16)
    fewest = max(measured, 48) if padded and measured is not None else None
    monkeypatch.setattr(ragged_attention, "rows_rounding_alike", lambda query_dim, value_dim: fewest)
    torch.manual_seed(3)
    heads, kv_heads, tokens, length, dim = 6, 2, 5, 300, 16
    query = torch.randn(1, tokens, heads, dim).transpose(1, 2)
    key, value = torch.randn(1, kv_heads, length, dim), torch.randn(1, kv_heads, length, dim)
    together = last_tokens_attention(query, key, value, 0.3)
    allowed = torch.arange(length).view(1, -1) <= torch.arange(length - tokens, length).view(-1, 1)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)
    for t in range(tokens):
        seen = length - tokens + 1 + t
        alone = last_tokens_attention(query[:, :, t : t + 1], key[:, :, :seen], value[:, :, :seen], 0.3)
        assert torch.equal(together[:, :, t : t + 1], alone), t


def test_the_threshold_is_measured_once_per_head_size_and_thread_count():
    row_rounding._measured.cache_clear()
    first = row_rounding.rows_rounding_alike(24, 24, threads=1)
    assert row_rounding.rows_rounding_alike(24, 24, threads=1) == first
    assert row_rounding._measured.cache_info().hits == 1 and row_rounding._measured.cache_info().misses == 1
    assert first is None or first in row_rounding.PROBE_ROWS
    row_rounding.rows_rounding_alike(24, 24, threads=2)
    assert row_rounding._measured.cache_info().misses == 2
