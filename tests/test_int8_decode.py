"""Decode and verify steps on int8 weights (``decode_weights``), and a kernel choice that is the
same on every start.

The int8 product must stay within the bound its rounding allows (the weights rounded to a step
of one per-channel scale, each row's activations to a step of 2/255 of its largest magnitude),
a row's result must not depend on the other rows of its step, nothing outside the engine's
steps may see the copy, and with decode reading the model's own weights every path stays exactly
what it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.decode_weights import int8_rows, small_rows
from kvboost_rag.decode_weights.int8_rows import (
    EDGE_COLUMNS,
    QMAX,
    DynamicInt8Linear,
    WeightOnlyInt8Linear,
    dynamic_int8_available,
    int8_available,
    int8_linear,
    quantize_rows,
)
from kvboost_rag.decode_weights.small_rows import choose_kernel, decode_reads, eligible_linears, model_key
from rag_prompts import rag_prompt

needs_int8 = pytest.mark.skipif(not int8_available(), reason="no int8 kernel with a vectorized CPU path here")


def kernels_used_here() -> list[type]:
    """The int8 kernels the engine may run on this CPU and torch build: FBGEMM's dynamic linear
    only where its 8-bit sums are exact (CPUs with VNNI; on an AVX2 CPU without it, such as an
    AMD EPYC of family 25, pairs of products saturate in 16 bits and the engine never runs it,
    which :func:`test_the_engine_chooses_the_dynamic_kernel_only_where_its_sums_are_exact`
    checks), the weight-only kernel wherever torch has it with a vectorized path."""
    kernels: list[type] = [DynamicInt8Linear] if dynamic_int8_available() else []
    if hasattr(torch.ops.aten, "_weight_int8pack_mm") and int8_available():
        kernels.append(WeightOnlyInt8Linear)
    return kernels


#: The int8 kernels, each where the engine may run it (the products of a kernel it never runs
#: here are not checked here: on a CPU whose sums saturate, FBGEMM's product is off its bound).
KERNELS = kernels_used_here()
#: FBGEMM's quantized ops are in this torch build (x86): its layout and checks can be built,
#: whether or not its sums are exact on this CPU.
has_fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="no FBGEMM in this torch build"
)


def test_quantized_rows_are_within_half_a_scale_step_of_the_weights():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=generator)
    weight[3] = 0.0  # a zero row keeps a usable scale
    weight[5, 7] = 50.0  # an outlier sets its row's scale only
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scales.shape == (48,) and scales.dtype == torch.float32
    assert int(q.abs().max()) <= QMAX and bool((q[3] == 0).all()) and float(scales[3]) == 1.0
    error = (q.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 * (1 + 1e-6)).all())
    assert float(scales[5]) == pytest.approx(50.0 / QMAX) and float(scales[4]) < float(scales[5]) / 10


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 40])
def test_the_int8_product_is_f_linear_within_its_rounding_bound(kernel, rows):
    """Stated tolerance, per output: the weights' rounding, ``sum |x| * scale / 2``, plus the
    activations' rounding the kernel states (``within_rounding``): for the dynamic kernel each
    row rounded to a step of ``2 / 255`` of its largest magnitude, ``max |x| / 255 * sum |w|``,
    with 1% for float32 arithmetic; for the weight-only kernel bfloat16 activations and sums."""
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=generator) * 0.05, torch.randn(96, generator=generator)
    x = torch.randn(2, rows, 64, generator=generator)
    x[0, 0, 5] = 40.0  # an outlier sets its own row's step only
    q, scales = quantize_rows(weight)
    dequantized = q.float() * scales[:, None]
    copy = kernel(q, scales, bias)
    assert torch.equal(copy.dequantized(), dequantized)
    got = copy(x)
    assert got.shape == (2, rows, 96) and got.dtype == torch.float32
    flat = x.reshape(-1, 64)
    assert copy.within_rounding(got.reshape(-1, 96) - bias, F.linear(flat, dequantized), flat, dequantized)
    weights_rounding = flat.abs() @ (scales / 2)[None, :].expand(64, -1)
    if kernel is DynamicInt8Linear:
        activations_rounding = 1.01 * flat.abs().amax(dim=1, keepdim=True) / 255 * dequantized.abs().sum(dim=1)
    else:
        activations_rounding = 2 * 2.0**-8 * (flat.abs() @ weight.abs().T) * 1.01 + 2.0**-7 * F.linear(flat, weight).abs()
    off_own = (got.reshape(-1, 96) - F.linear(flat, weight, bias)).abs()
    assert bool((off_own <= weights_rounding * 1.01 + activations_rounding + 1e-5 * F.linear(flat, weight).abs() + 1e-5).all())


@has_fbgemm
def test_the_dynamic_rounding_bound_rejects_a_product_off_by_more():
    generator = torch.Generator().manual_seed(2)
    weight, x = torch.randn(16, 32, generator=generator), torch.randn(3, 32, generator=generator)
    expected = F.linear(x, weight)
    bound = x.abs().amax(dim=1, keepdim=True) / 255 * weight.abs().sum(dim=1)
    check = DynamicInt8Linear(*quantize_rows(weight), None)
    assert check.within_rounding(expected + 0.9 * bound, expected, x, weight)
    assert not check.within_rounding(expected + 1.2 * bound, expected, x, weight)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_gets_the_same_int8_result_alone_or_among_others(kernel):
    """Greedy tokens then do not depend on how many rows (drafts, other sequences) a step has,
    even where one row's activations are a thousand times another's."""
    generator = torch.Generator().manual_seed(1)
    run = kernel(*quantize_rows(torch.randn(80, 48, generator=generator)), None)
    x = torch.randn(12, 48, generator=generator)
    x[4] *= 1000.0
    x[7] *= 1e-3
    assert torch.equal(run(x), torch.cat([run(x[i : i + 1]) for i in range(12)]))


@has_fbgemm
def test_the_check_at_load_tells_exact_sums_from_saturating_ones(monkeypatch):
    """Without VNNI, pairs of u8 x s8 products are summed in 16 bits: the check's worst case
    (every activation and weight at the top of the range) comes back clipped. Both outcomes are
    put to the check on any CPU: a product that sums exactly, and one clipped as such a CPU clips."""

    def exact(self: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())

    monkeypatch.setattr(DynamicInt8Linear, "__call__", exact)
    assert int8_rows._sums_exactly()
    monkeypatch.setattr(DynamicInt8Linear, "__call__", lambda self, x: exact(self, x) * (32767 / (255 * 127 * 2)))
    assert not int8_rows._sums_exactly()


@needs_int8
@has_fbgemm
def test_the_engine_chooses_the_dynamic_kernel_only_where_its_sums_are_exact(recwarn):
    """On this CPU: the dynamic kernel where the check at load finds its sums exact (and then
    its product keeps its bound on random rows), the weight-only kernel where they saturate (and
    then FBGEMM's product is off that bound, so running it would have been wrong); no warning."""
    generator = torch.Generator().manual_seed(3)
    weight, x = torch.randn(96, 64, generator=generator) * 0.05, torch.randn(8, 64, generator=generator)
    q, scales = quantize_rows(weight)
    copy = int8_linear(q, scales, None)
    assert isinstance(copy, DynamicInt8Linear if int8_rows._sums_exactly() else WeightOnlyInt8Linear)
    dynamic = DynamicInt8Linear(q, scales, None)
    dequantized = dynamic.dequantized()
    within = dynamic.within_rounding(dynamic(x), F.linear(x, dequantized), x, dequantized)
    assert within == isinstance(copy, DynamicInt8Linear)
    assert copy.within_rounding(copy(x), F.linear(x, copy.dequantized()), x, copy.dequantized())
    assert not [w for w in recwarn.list if "quantized" in str(w.message)]


@needs_int8
def test_the_int8_copy_serves_only_inside_steps_and_holds_a_quarter_of_the_bytes():
    model = tiny_model("qwen2")  # biased projections, a tied output layer
    layers = eligible_linears(model)
    chosen = choose_kernel(model, "off", packed_bytes=0, decode_weights="int8")
    assert chosen.kernel == "int8" and set(chosen.weights) == set(layers)
    float_bytes = sum(layer.weight.numel() * 4 for layer in layers)
    expected = sum(chosen.weights[layer].nbytes for layer in layers)
    if dynamic_int8_available():
        assert expected == sum(layer.out_features * (layer.in_features + EDGE_COLUMNS + 12) for layer in layers)
    assert chosen.copy_bytes == expected and chosen.copy_bytes < float_bytes / 3
    for layer in (layers[0], model.lm_head):
        x = torch.randn(4, layer.in_features)
        own = F.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), own)  # outside a step: the model's own product
        with torch.inference_mode(), chosen.active():
            inside = chosen.in_view(layer)(x)
            assert torch.equal(layer(x), own)  # the model's own module: never routed
            wide = torch.randn(small_rows.MAX_ROWS + 1, layer.in_features)
            assert torch.equal(chosen.in_view(layer)(wide), F.linear(wide, layer.weight, layer.bias))  # a prefill: the own weights
        assert not torch.equal(inside, own)
        dequantized = chosen.weights[layer].dequantized()
        unbiased = inside - (layer.bias if layer.bias is not None else 0)
        assert chosen.weights[layer].within_rounding(unbiased, F.linear(x, dequantized), x, dequantized)
    chosen.restore()
    assert all("forward" not in layer.__dict__ for layer in layers) and chosen.kernel == "off" and chosen.copy_bytes == 0


@pytest.mark.parametrize(
    "setting,decode_weights,listed,packed_min",
    [
        ("auto", "auto", False, None),
        ("auto", "auto", True, None),
        ("auto", "model", True, 0),
        ("packed", "model", False, None),
        ("off", "int8", False, None),
    ],
)
def test_the_kernel_choice_is_the_same_on_every_start(monkeypatch, setting, decode_weights, listed, packed_min):
    """Ten starts of the same model with the same settings choose the same kernel: a rule over
    the model, its dtype, the device and the torch build, nothing timed."""
    model = tiny_model("llama")
    if listed:
        monkeypatch.setattr(small_rows, "INT8_BY_DEFAULT", frozenset({model_key(model)}))
    if packed_min is not None:
        monkeypatch.setattr(small_rows, "PACKED_MIN_BYTES", packed_min)
    kernels = []
    for _ in range(10):
        chosen = choose_kernel(model, setting, packed_bytes=2**30, decode_weights=decode_weights)
        kernels.append(chosen.kernel)
        chosen.restore()
    assert len(set(kernels)) == 1
    onednn, int8 = small_rows.onednn_available(), int8_available()
    expected = {
        ("auto", "auto", False): "off",  # tiny layers: F.linear, and no int8 measured for this model
        ("auto", "auto", True): "int8" if int8 else "off",
        ("auto", "model", True): "packed" if onednn else "off",
        ("packed", "model", False): "packed" if onednn else "off",
        ("off", "int8", False): "int8" if int8 else "off",
    }[(setting, decode_weights, listed)]
    assert kernels[0] == expected


def test_int8_by_default_only_for_the_models_measured(monkeypatch):
    assert ("qwen2", 896, 24, 151936) in small_rows.INT8_BY_DEFAULT  # Qwen2.5(-Coder)-0.5B, measured
    assert ("llama", 576, 30, 49152) not in small_rows.INT8_BY_DEFAULT  # the embedded model, measured: off
    model = tiny_model("qwen2")
    assert decode_reads(model, "model") == "model"
    assert decode_reads(model, "auto") == "model"  # a model nobody measured
    monkeypatch.setattr(small_rows, "INT8_BY_DEFAULT", frozenset({model_key(model)}))
    assert decode_reads(model, "auto") == ("int8" if int8_available() else "model")
    assert decode_reads(model, "int8") == ("int8" if int8_available() else "model")


def test_with_decode_on_the_models_own_weights_every_step_stays_exact(make_engine, docs):
    """``decode_weights="model"`` routes nothing on a tiny model: tokens and step logits are
    bit for bit those of the model's own ``F.linear`` path."""
    prompt = rag_prompt([docs[1], docs[0]], "Summarize.")
    default = make_engine("llama", draft_tokens=0)
    own = make_engine("llama", draft_tokens=0, decode_weights="model", small_row_kernels="off")
    assert default.small_row_kernel == own.small_row_kernel == "off"
    assert all("forward" not in layer.__dict__ for layer in eligible_linears(default.model))
    a = default.generate(prompt, max_new_tokens=12, return_logits=True)
    b = own.generate(prompt, max_new_tokens=12, return_logits=True)
    assert a.token_ids == b.token_ids and torch.equal(a.step_logits, b.step_logits)


@needs_int8
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_engine_decodes_on_int8_and_the_users_model_calls_stay_its_own(make_engine, docs, family):
    engine = make_engine(family, decode_weights="int8")
    own = make_engine(family, decode_weights="model", small_row_kernels="off", draft_tokens=0)
    assert engine.small_row_kernel == "int8" and engine._adapter.small_rows.copy_bytes > 0
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        before = engine.model(ids).logits
    prompt = rag_prompt([docs[2], docs[0]], "What does it say?")
    answer = engine.generate(prompt, max_new_tokens=16)
    batch = engine.generate_batch([prompt, rag_prompt([docs[3]], "Summarize.")], max_new_tokens=8)
    reference = own.generate(prompt, max_new_tokens=16)
    assert len(answer.token_ids) == 16 and answer.decode_steps > 0 and all(len(r.token_ids) == 8 for r in batch)
    assert answer.token_ids[0] == reference.token_ids[0]  # the first token: prefill, on the own weights
    with torch.inference_mode():
        assert torch.equal(engine.model(ids).logits, before)  # outside a step: untouched


def verify_and_one_token_logits(engine, ids: list[int], drafted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the last ``drafted`` tokens of ``ids`` in one verify pass, and in one-token
    passes at the same positions, over the same cache."""
    from kvboost_rag.hf.caches import truncate_cache
    from kvboost_rag.hf.packed import Segment

    adapter, held = engine._adapter, len(ids) - drafted
    cache = adapter.new_cache(len(ids) + 4)
    with torch.inference_mode():
        adapter.forward(torch.tensor(ids[:held]), torch.arange(held), cache)
        verify = adapter.forward_packed([Segment(torch.tensor(ids[held:]), torch.arange(held, len(ids)), cache, logits=drafted, decode=True)])
        truncate_cache(cache, held)
        steps = [
            adapter.forward_packed([Segment(torch.tensor(ids[p : p + 1]), torch.arange(p, p + 1), cache, logits=1, decode=True)])[0].logits
            for p in range(held, len(ids))
        ]
    return verify[0].logits, torch.cat(steps)


@needs_int8
@pytest.mark.parametrize("drafted", [3, 16])
def test_on_int8_a_verify_steps_logits_are_bitwise_those_of_one_token_steps(make_engine, docs, drafted):
    """Greedy tokens must not depend on drafts: every layer reads int8 (each row on its own) and
    the short rows' attention computes each token as it would alone."""
    engine = make_engine("qwen2", decode_weights="int8")
    ids = engine.tokenizer(rag_prompt([*docs, *docs, *docs], "What does it say?")).input_ids
    assert len(ids) > 1500  # products over this many keys round by their count of keys on MKL
    for length in (len(ids), 40):  # a long row, and one whose tokens attend one by one
        verify, steps = verify_and_one_token_logits(engine, ids[:length], drafted)
        assert torch.equal(verify, steps), length


@needs_int8
def test_on_int8_the_same_prompt_asked_again_gets_bitwise_the_same_answer(make_engine):
    """Decode rounds activations, so float32 rounding differences in the prompt's K/V could
    grow into another answer: the first call runs the last prompt token in a pass of its own,
    as the second call (a prefix hit of every other token, the first call's K/V) does, so every
    step's logits are the first call's."""
    engine = make_engine("qwen2", decode_weights="int8")
    prompt = "The cache keeps the keys and values of every document it has read, and reads them again. " * 10
    first = engine.generate(prompt, max_new_tokens=16, return_logits=True)
    engine.flush()
    again = engine.generate(prompt, max_new_tokens=16, return_logits=True)
    assert again.prefix_hit_tokens == first.prompt_tokens - 1 > 100
    assert again.token_ids == first.token_ids
    assert len(again.step_logits) == len(first.step_logits) == 16
    assert all(torch.equal(a, b) for a, b in zip(first.step_logits, again.step_logits))
