"""Int8 layers that read one input multiplied as one product (:mod:`kvboost_rag.decode_weights.int8_siblings`).

Each layer must get exactly its own columns of the fused product, whatever order the model
calls the group's layers in and whether or not they are called on the same input; nothing may
be held once every layer took its output; and an engine on int8 weights must decode what the
same engine decodes with every layer as its own product.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
from kvboost_rag.decode_weights import small_rows
from kvboost_rag.decode_weights.int8_rows import int8_available, int8_linear, quantize_rows
from kvboost_rag.decode_weights.int8_siblings import SiblingProduct, fused_int8, sibling_groups
from kvboost_rag.decode_weights.small_rows import choose_kernel, eligible_linears

pytestmark = pytest.mark.skipif(not int8_available(), reason="no int8 kernel with a vectorized CPU path here")


def _own_product(layer: torch.nn.Linear):
    return int8_linear(*quantize_rows(layer.weight), layer.bias)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_groups_are_each_layers_query_key_value_and_gate_up(family):
    model = tiny_model(family)
    groups = sibling_groups(model, eligible_linears(model))
    layers = model.config.num_hidden_layers
    assert len(groups) == 2 * layers
    for i, decoder in enumerate(model.model.layers):
        attention, mlp = decoder.self_attn, decoder.mlp
        assert groups[2 * i] == [attention.q_proj, attention.k_proj, attention.v_proj]
        assert groups[2 * i + 1] == [mlp.gate_proj, mlp.up_proj]
    without_keys = [layer for layer in eligible_linears(model) if layer is not model.model.layers[0].self_attn.k_proj]
    assert len(sibling_groups(model, without_keys)) == 2 * layers - 1  # a group only whole


@torch.inference_mode()
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 1, 0, 2)])
def test_each_layer_gets_its_own_columns_in_any_order(order):
    model = tiny_model("qwen2")  # biased query, key and value projections
    group = sibling_groups(model, eligible_linears(model))[0]
    products = fused_int8(group)
    x = torch.randn(1, 3, group[0].in_features)
    for index in order:
        expected = _own_product(group[index])(x)
        got = products[index](x)
        assert got.shape == expected.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    other = torch.randn(1, 2, group[0].in_features)  # another input: computed anew
    torch.testing.assert_close(products[1](other), _own_product(group[1])(other), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_nothing_is_held_once_every_layer_took_its_output():
    model = tiny_model("llama")
    group = sibling_groups(model, eligible_linears(model))[1]  # gate and up
    products = fused_int8(group)
    x = torch.randn(1, 1, group[0].in_features)
    held = weakref.ref(x)
    products[0](x)
    products[1](x)
    del x
    gc.collect()
    assert held() is None
    assert products[0].nbytes + products[1].nbytes == products[0].shared.fused.nbytes


@torch.inference_mode()
def test_the_int8_kernel_check_passes_and_every_grouped_layer_routes_through_its_group():
    model = tiny_model("qwen2")
    chosen = choose_kernel(model, "off", packed_bytes=0, decode_weights="int8")
    assert chosen.kernel == "int8"
    grouped = [layer for group in sibling_groups(model, eligible_linears(model)) for layer in group]
    assert all(isinstance(chosen.weights[layer], SiblingProduct) for layer in grouped)
    assert not isinstance(chosen.weights[model.lm_head], SiblingProduct)
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 1, attention.q_proj.in_features)
    view = chosen.in_view(attention)
    with chosen.active():
        inside = [view.q_proj(x), view.k_proj(x), view.v_proj(x)]
    for layer, got in zip((attention.q_proj, attention.k_proj, attention.v_proj), inside):
        dequantized = chosen.weights[layer].dequantized()
        assert chosen.weights[layer].within_rounding(got - layer.bias, F.linear(x, dequantized), x, dequantized)
    chosen.restore()


def test_grouped_layers_decode_what_separate_layers_decode(monkeypatch):
    tokenizer = tiny_tokenizer()
    prompt = "The cache keeps the keys and values of every document it has read. " * 6

    def answer() -> list[int]:
        engine = KVBoost.from_model(tiny_model("qwen2"), tokenizer, decode_weights="int8", draft_tokens=0, show_progress=False)
        assert engine._adapter.small_rows.kernel == "int8"
        return engine.generate(prompt, max_new_tokens=12).token_ids

    grouped = answer()
    monkeypatch.setattr(small_rows, "sibling_groups", lambda model, modules: [])
    assert answer() == grouped


def test_the_kernel_bench_groups_layers_as_the_engine_does():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import int8_kernels

    config = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 100}
    shapes = int8_kernels.layer_shapes(config)
    groups = int8_kernels.fused_groups(len(shapes))
    assert groups == [[0, 1, 2], [3], [4, 5], [6], [7, 8, 9], [10], [11, 12], [13], [14]]
    model = tiny_model("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2)
    engine_groups = sibling_groups(model, eligible_linears(model))
    assert [len(g) for g in groups if len(g) > 1] == [len(g) for g in engine_groups]
