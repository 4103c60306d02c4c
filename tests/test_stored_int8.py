"""Models quantized through torchao (transformers' ``TorchAoConfig``): the engine loads them,
answers as the model does, and decode reads their int8 layers from the stored values.

A torchao ``Int8Tensor`` weight has no float32 data: the fingerprint, the embedding table's
paging and the small-row kernels must take it as it is, reading its stored int8 values and
per-channel scales where decode reads int8, and leaving every other call to the layer's own
``forward``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torchao_quantization = pytest.importorskip("torchao.quantization", reason="torchao is the `torchao` extra (scripts/setup.sh --test installs it)")
from transformers import AutoModelForCausalLM, TorchAoConfig  # noqa: E402

from kvboost_rag import KVBoost  # noqa: E402
from kvboost_rag.dev.testing import save_tiny_model, tiny_model  # noqa: E402
from kvboost_rag.hf.fingerprint import weights_digest  # noqa: E402
from kvboost_rag.decode_weights.int8_rows import int8_available  # noqa: E402
from kvboost_rag.decode_weights.resident import page_out_input_embeddings  # noqa: E402
from kvboost_rag.decode_weights.small_rows import plain_linears  # noqa: E402
from kvboost_rag.decode_weights.stored_int8 import stored_int8, stored_int8_linears  # noqa: E402
from rag_prompts import rag_prompt  # noqa: E402

quantize_ = torchao_quantization.quantize_


def WEIGHT_ONLY(**options):  # noqa: N802 - stands for the config class
    """torchao's int8 weight-only config, leaving torch's compiler settings alone (by default
    it changes them process-wide, which later tests in this worker would inherit)."""
    return torchao_quantization.Int8WeightOnlyConfig(set_inductor_config=False, **options)


def DYNAMIC(**options):  # noqa: N802
    """torchao's int8 dynamic-activation config, compiler settings left alone."""
    return torchao_quantization.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False, **options)

needs_int8 = pytest.mark.skipif(not int8_available(), reason="no int8 kernel with a vectorized CPU path here")


def quantized_model(family: str = "qwen2", config=None, seed: int = 0) -> torch.nn.Module:
    model = tiny_model(family, seed=seed)
    quantize_(model, config if config is not None else WEIGHT_ONLY())
    return model


def engine_over(model: torch.nn.Module, tokenizer, **settings) -> KVBoost:
    return KVBoost.from_model(model, tokenizer, show_progress=False, chunk_size=32, **settings)


def greedy(model: torch.nn.Module, ids: list[int], new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("config", [WEIGHT_ONLY, DYNAMIC])
def test_an_int8_weight_is_read_as_its_stored_values_and_scales(config):
    layer = torch.nn.Linear(96, 40)
    quantize_(layer, config())
    q, scales = stored_int8(layer.weight)
    assert q.data_ptr() == layer.weight.qdata.data_ptr()  # the stored tensor itself, not a copy
    assert q.dtype == torch.int8 and q.shape == (40, 96) and scales.shape == (40,) and scales.dtype == torch.float32
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    layer.requires_grad_(False)
    expected = F.linear(x, q.float() * scales[:, None], layer.bias)
    if config is WEIGHT_ONLY:  # the layer's own product is exactly these values' (float activations)
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    else:  # its own rounds the activations to 8 bits per row: within that rounding
        assert torch.allclose(layer(x), expected, rtol=0.05, atol=0.05 * float(expected.abs().max()))


def test_weights_of_another_form_are_not_read_as_int8():
    plain = torch.nn.Linear(64, 32)
    assert stored_int8(plain.weight) is None
    grouped = torch.nn.Linear(64, 32)
    quantize_(grouped, WEIGHT_ONLY(granularity=torchao_quantization.PerGroup(32)))  # two scales per channel: not the kernels' form
    assert type(grouped.weight).__name__ == "Int8Tensor" and stored_int8(grouped.weight) is None
    half = torch.nn.Linear(64, 32).to(torch.bfloat16)
    quantize_(half, WEIGHT_ONLY())  # a bfloat16 layer: the kernels take float32 activations
    assert type(half.weight).__name__ == "Int8Tensor" and stored_int8(half.weight) is None
    model = quantized_model("llama")
    found = stored_int8_linears(plain_linears(model))
    assert list(found) == [m for m in model.modules() if type(m) is torch.nn.Linear] and len(found) > 0


def test_the_fingerprint_reads_the_stored_values():
    """Two quantized models that differ in weights differ in digest; the same one digests alike;
    and a quantized model is not the float one it came from."""
    a, b = quantized_model(seed=0), quantized_model(seed=1)
    assert weights_digest(a) == weights_digest(quantized_model(seed=0))
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(a) != weights_digest(tiny_model("qwen2", seed=0))
    assert weights_digest(a) != weights_digest(quantized_model(config=DYNAMIC()))  # same values, other product
    layer = next(iter(stored_int8_linears(plain_linears(a))))
    before = weights_digest(a)
    with torch.no_grad():
        layer.weight.qdata[0, 0] += 1  # one stored value moved
    assert weights_digest(a) != before


def test_paging_skips_an_output_layer_quantized_apart_from_the_table():
    model = quantized_model("llama")  # quantize_ replaced the output layer's weight: no longer tied
    assert type(model.get_output_embeddings().weight).__name__ == "Int8Tensor"
    assert page_out_input_embeddings(model) >= 0  # the float table may be paged; nothing raises


@pytest.mark.parametrize("config", [WEIGHT_ONLY, DYNAMIC])
def test_an_engine_over_a_torchao_model_answers_as_the_model_does(tokenizer, docs, config):
    """Decode on the model's own layers (``decode_weights="model"``): the engine's greedy tokens
    are ``generate``'s, and a prefix hit gives the first call's tokens."""
    model = quantized_model(config=config())
    engine = engine_over(model, tokenizer, decode_weights="model", draft_tokens=0)
    assert engine.small_row_kernel == "off" and not engine._adapter.small_rows.routed
    prompt = rag_prompt([docs[1], docs[0]], "Summarize.")
    ids = tokenizer(prompt).input_ids
    first = engine.generate(prompt, max_new_tokens=12, reuse=False, return_logits=True)
    assert first.token_ids == greedy(model, ids, 12)
    engine.warm(prompt[: len(prompt) // 2])
    again = engine.generate(prompt, max_new_tokens=12, return_logits=True)
    assert again.prefix_hit_tokens > 0
    if config is WEIGHT_ONLY:  # row-independent products: reuse is exact to float32 rounding
        assert again.token_ids == first.token_ids
        assert torch.allclose(again.first_token_logits, first.first_token_logits, atol=1e-4)


@needs_int8
def test_decode_on_int8_reads_the_stored_values_and_leaves_other_calls_to_the_layers(tokenizer, docs):
    model = quantized_model()
    stored = stored_int8_linears(plain_linears(model))
    engine = engine_over(model, tokenizer, decode_weights="int8")
    linears = engine._adapter.small_rows
    assert engine.small_row_kernel == "int8" and set(linears.weights) == set(stored)
    for layer, (q, scales) in stored.items():  # the copies hold the stored values, not requantized ones
        copy = linears.weights[layer]
        assert torch.equal(copy.dequantized(), q.float() * scales[:, None])
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        before = model(ids).logits
    prompt = rag_prompt([docs[2], docs[0]], "What does it say?")
    answer = engine.generate(prompt, max_new_tokens=16)
    own = greedy(model, tokenizer(prompt).input_ids, 16)
    assert len(answer.token_ids) == 16 and answer.decode_steps > 0
    assert answer.token_ids[0] == own[0]  # the first token: prefill, through the layers' own forward
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)  # outside a step: the layers' own product


def test_a_saved_torchao_checkpoint_loads_and_answers(tmp_path, tokenizer):
    """What transformers writes for ``TorchAoConfig`` loads through ``KVBoost.from_pretrained``
    (the configuration in the checkpoint quantizes it again) and answers as the model does."""
    folder = save_tiny_model(tmp_path / "float", "qwen2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=TorchAoConfig(WEIGHT_ONLY()))
    model.save_pretrained(tmp_path / "int8")
    tokenizer.save_pretrained(tmp_path / "int8")
    engine = KVBoost.from_pretrained(str(tmp_path / "int8"), show_progress=False, decode_weights="model", draft_tokens=0)
    assert len(stored_int8_linears(plain_linears(engine.model))) > 0
    ids = tokenizer("The cache reads each document once.").input_ids
    assert engine.generate("The cache reads each document once.", max_new_tokens=6).token_ids == greedy(engine.model, ids, 6)
