"""Layers whose weights are 4-bit runs read as stored (:mod:`kvboost_rag.decode_weights.four_bit_groups`).

The search must find exactly the weights that are 16 evenly spaced values per run of 32 (every
form a GGUF file's 4-bit types take: offset grids, symmetric ones, runs that use fewer levels,
constant runs) and refuse anything else; the product must compute the layer's own result within
its bfloat16 rounding; the engine must read them as stored only where ``decode_weights`` allows,
and prefill must still read the model's own weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
from kvboost_rag.decode_weights import four_bit_groups as fb
from kvboost_rag.decode_weights.int8_siblings import SiblingProduct, sibling_groups
from kvboost_rag.decode_weights.small_rows import choose_kernel, eligible_linears

needs_kernel = pytest.mark.skipif(not fb.four_bit_available(), reason="no CPU 4-bit kernel in this torch build")


def four_bit_weight(rows: int, width: int, seed: int = 0, levels: int = 15) -> torch.Tensor:
    """A ``[rows, width]`` weight of 4-bit runs as a GGUF file's dequantized tensor holds them:
    each run ``low + step * q`` with its own step and low, some runs using fewer levels."""
    generator = torch.Generator().manual_seed(seed)
    runs = width // fb.GROUP
    steps = torch.rand(rows, runs, 1, generator=generator) * 0.01 + 1e-4
    lows = -8 * steps + torch.randn(rows, runs, 1, generator=generator) * 0.01
    top = torch.randint(1, levels + 1, (rows, runs, 1), generator=generator)  # the largest level each run reaches
    q = (torch.rand(rows, runs, fb.GROUP, generator=generator) * (top + 1)).floor().clamp_max(top)
    q[..., 0] = 0
    q[..., 1] = top[..., 0]
    return (lows + steps * q).reshape(rows, width)


def make_four_bit(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every eligible layer's weight replaced by 4-bit runs."""
    with torch.no_grad():
        for i, layer in enumerate(eligible_linears(model)):
            layer.weight.copy_(four_bit_weight(*layer.weight.shape, seed=i))
    return model


def test_the_search_finds_the_runs_and_their_values_exactly():
    weight = four_bit_weight(48, 128)
    weight[3, :32] = 0.25  # a constant run
    weight[5, 32:64] = 0.01 * (torch.arange(32) % 16 - 8)  # symmetric, as Q4_0 stores
    groups = fb.four_bit_groups(weight)
    assert groups is not None
    assert int(groups.values.min()) >= 0 and int(groups.values.max()) <= fb.LEVELS
    assert groups.steps.shape == groups.lows.shape == (48, 4)
    torch.testing.assert_close(groups.dequantized(), weight, rtol=0, atol=1e-7)


def test_the_search_refuses_float_and_five_bit_weights():
    generator = torch.Generator().manual_seed(1)
    assert fb.four_bit_groups(torch.randn(32, 64, generator=generator)) is None
    five_bit = torch.randint(0, 32, (32, 64), generator=generator).float() * 0.01  # 32 levels per run
    assert fb.four_bit_groups(five_bit) is None
    assert fb.four_bit_groups(five_bit.div(2).floor()) is not None  # the same runs on 16 levels


def test_the_search_refuses_one_run_off_the_grid_and_shapes_the_kernel_cannot_pack():
    weight = four_bit_weight(32, 64)
    assert fb.four_bit_groups(weight) is not None
    off = weight.clone()
    off[17, 40] += 0.3 * (off[17, 32:64].max() - off[17, 32:64].min()) / 15  # a third of a step off
    assert fb.four_bit_groups(off) is None
    assert fb.four_bit_groups(four_bit_weight(32, 64)[:, :48]) is None  # 48 wide: not runs of 32
    assert fb.four_bit_groups(four_bit_weight(40, 64)) is None  # 40 rows: not packed by 16


@needs_kernel
@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_product_is_the_layers_own_within_bfloat16_rounding(rows):
    weight = four_bit_weight(96, 128, seed=3)
    bias = torch.randn(96)
    copy = fb.FourBitLinear(fb.four_bit_groups(weight), bias)
    x = torch.randn(1, rows, 128)
    got = copy(x)
    expected = F.linear(x, weight, bias)
    assert got.shape == (1, rows, 96) and got.dtype == torch.float32
    assert copy.within_rounding(got - bias, expected - bias, x.view(rows, 128), weight)
    assert not copy.within_rounding(got - bias + 0.05 * expected.abs().max(), expected - bias, x.view(rows, 128), weight)
    assert copy.nbytes < weight.numel() * 4 / 6  # about an eighth of the float32 bytes


@needs_kernel
@torch.inference_mode()
def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_step():
    """Drafts and other sequences in a step must change no greedy token: each row's product is
    the same alone as among others."""
    weight = four_bit_weight(160, 256, seed=5)
    copy = fb.FourBitLinear(fb.four_bit_groups(weight), None)
    x = torch.randn(16, 256)
    together = copy(x)
    assert torch.equal(together, torch.cat([copy(x[i : i + 1]) for i in range(16)]))
    assert torch.equal(together[:5], copy(x[:5]))


@needs_kernel
@torch.inference_mode()
def test_siblings_are_one_product_and_each_layer_gets_its_own_columns():
    model = make_four_bit(tiny_model("qwen2"))  # biased query, key and value projections
    copies = fb.four_bit_linears(model, eligible_linears(model))
    assert list(copies) == eligible_linears(model)
    attention = model.model.layers[0].self_attn
    group = [attention.q_proj, attention.k_proj, attention.v_proj]
    assert all(isinstance(copies[layer], SiblingProduct) for layer in group)
    assert len({id(copies[layer].shared) for layer in group}) == 1
    x = torch.randn(1, 1, attention.q_proj.in_features)
    for layer in (group[2], group[0], group[1]):
        alone = fb.FourBitLinear(fb.four_bit_groups(layer.weight), layer.bias)
        torch.testing.assert_close(copies[layer](x), alone(x), rtol=1e-2, atol=1e-3)


@needs_kernel
def test_the_engine_reads_four_bit_runs_as_stored_only_where_decode_weights_says():
    model = make_four_bit(tiny_model("llama"))
    grouped = [layer for group in sibling_groups(model, eligible_linears(model)) for layer in group]
    auto = choose_kernel(model, "off", 0, decode_weights="stored")
    assert set(grouped) <= set(auto.four_bit) and auto.routed and auto.kernel == "off"
    assert auto.copy_bytes == sum(copy.nbytes for copy in auto.four_bit.values())
    x = torch.randn(1, 1, model.config.hidden_size)
    layer = model.model.layers[0].mlp.gate_proj
    with torch.inference_mode():
        outside = layer(x)
        with auto.active():
            inside = auto.in_view(layer)(x)
            assert torch.equal(layer(x), outside)  # the model's own module: never routed
    assert torch.equal(outside, F.linear(x, layer.weight))  # outside the steps: the model's own product
    assert not torch.equal(inside, outside) and torch.allclose(inside, outside, rtol=0.05, atol=1e-3)
    auto.restore()
    assert "forward" not in layer.__dict__ and not auto.four_bit
    for setting in ("model", "auto"):  # "auto": int8 (and so the runs) only for the measured models
        own = choose_kernel(model, "off", 0, decode_weights=setting)
        assert not own.four_bit and not own.routed
        own.restore()
    plain = choose_kernel(tiny_model("llama"), "off", 0, decode_weights="stored")
    assert not plain.four_bit  # random float weights are not 4-bit runs


@needs_kernel
def test_an_engine_decodes_on_four_bit_runs_with_the_first_token_from_its_own_weights():
    tokenizer = tiny_tokenizer()
    prompt = "The cache keeps the keys and values of every document it has read. " * 6

    def engine(decode_weights: str) -> KVBoost:
        return KVBoost.from_model(
            make_four_bit(tiny_model("qwen2")), tokenizer, decode_weights=decode_weights, draft_tokens=0, show_progress=False
        )

    stored, own = engine("stored"), engine("model")
    assert stored._adapter.small_rows.four_bit and not own._adapter.small_rows.four_bit
    a, b = stored.generate(prompt, max_new_tokens=16), own.generate(prompt, max_new_tokens=16)
    assert a.token_ids[0] == b.token_ids[0]  # prefill reads the model's own weights
    assert len(a.token_ids) == len(b.token_ids) == 16


def test_no_kernel_no_four_bit_layers(monkeypatch):
    monkeypatch.setattr(fb, "four_bit_available", lambda: False)
    model = make_four_bit(tiny_model("llama"))
    assert fb.four_bit_linears(model, eligible_linears(model)) == {}


@needs_kernel
@torch.inference_mode()
def test_prompt_work_beside_decode_rows_reads_the_models_own_weights():
    """In one packed pass, decode rows read the stored runs and a prompt slice the model's own
    weights, each as in a pass of its own, whatever order the segments come in."""
    from kvboost_rag.hf.packed import Segment

    engine = KVBoost.from_model(make_four_bit(tiny_model("llama")), tiny_tokenizer(), decode_weights="stored", show_progress=False)
    adapter = engine._adapter
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(2))

    def prefilled(length: int):
        cache = adapter.new_cache(64)
        adapter.forward(ids[:length], torch.arange(length), cache)
        return cache

    def prompt():
        return Segment(ids[20:30], torch.arange(20, 30), prefilled(20), logits=1)

    def row(decode: bool = True):
        return Segment(ids[30:33], torch.arange(30, 33), prefilled(30), logits=3, decode=decode)

    together = adapter.forward_packed([prompt(), row()])
    prompt_alone, row_alone, row_on_own_weights = (adapter.forward_packed([s])[0] for s in (prompt(), row(), row(False)))
    torch.testing.assert_close(together[0].logits, prompt_alone.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(together[1].logits, row_alone.logits, rtol=0, atol=1e-5)
    assert not torch.allclose(row_alone.logits, row_on_own_weights.logits, rtol=0, atol=1e-4)  # the rows read the runs
    with adapter.small_rows.active(0):  # no decode rows: the prompt's own weights
        assert torch.equal(adapter.decoding_model().lm_head(torch.ones(1, 2, 64)), F.linear(torch.ones(1, 2, 64), adapter.model.lm_head.weight))
