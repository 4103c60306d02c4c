"""Decode-only packed passes outside the model's module stack (:mod:`kvboost_rag.hf.decode_pass`).

The direct pass must give bitwise the logits and K/V of the model's own packed pass on every
family it serves, in float32 and bfloat16, on the model's own weights and on int8, for one-token
rows and verify rows side by side; it must refuse what it does not follow (other families, hooks,
prompt work) and its check at load must catch a model it would compute differently.
"""

from __future__ import annotations

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.hf import decode_pass as decode_pass_module
from kvboost_rag.hf.decode_pass import DecodePass, unsupported_reason
from kvboost_rag.decode_weights import small_rows
from kvboost_rag.decode_weights.int8_rows import int8_available
from kvboost_rag.hf.packed import Segment
from rag_prompts import rag_prompt

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma"]
DECODE_WEIGHTS = ["model", pytest.param("int8", marks=pytest.mark.skipif(not int8_available(), reason="no int8 kernel here"))]


def _engine(tokenizer, family: str, dtype: torch.dtype = torch.float32, **settings) -> KVBoost:
    return KVBoost.from_model(tiny_model(family, dtype=dtype), tokenizer, show_progress=False, chunk_size=32, **settings)


def _steps(adapter, ids: list[int]) -> tuple[list[Segment], list[int]]:
    """A step of three sequences over caches of different lengths: a one-token row, a 4-token
    verify row, and another one-token row; and the caches' lengths before it."""
    segments, lengths = [], []
    for held, rows in ((20, 1), (90, 4), (75, 1)):
        cache = adapter.new_cache(held + rows + 2)
        adapter.forward(torch.tensor(ids[:held]), torch.arange(held), cache)
        segments.append(Segment(torch.tensor(ids[held : held + rows]), torch.arange(held, held + rows), cache, logits=rows, decode=True))
        lengths.append(held)
    return segments, lengths


def _outputs(run, segments: list[Segment], lengths: list[int]) -> list[torch.Tensor]:
    """The logits ``run`` gives ``segments`` and the K/V it writes (the caches truncated back)."""
    assert [segment.cache.get_seq_length() for segment in segments] == lengths
    return decode_pass_module._logits_and_kv(run, segments)


@torch.inference_mode()
@pytest.mark.parametrize("decode_weights", DECODE_WEIGHTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_direct_pass_gives_bitwise_the_models_logits_and_kv(tokenizer, docs, family, decode_weights):
    engine = _engine(tokenizer, family, decode_weights=decode_weights)
    adapter = engine._adapter
    assert adapter.decode_pass is not None
    ids = engine.tokenizer(rag_prompt(docs[:3], "What does it say?")).input_ids
    segments, lengths = _steps(adapter, ids)
    assert adapter.decode_pass.takes(segments)
    expected = _outputs(adapter.forward_packed_by_model, segments, lengths)
    got = _outputs(adapter.forward_packed, segments, lengths)
    assert [t.shape for t in got] == [t.shape for t in expected]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert expected[1].shape[0] == 4 and not torch.equal(expected[0][0], expected[1][0])  # rows of their own


@torch.inference_mode()
def test_in_bfloat16_the_direct_pass_gives_bitwise_the_models_logits(tokenizer, docs):
    engine = _engine(tokenizer, "llama", dtype=torch.bfloat16)
    adapter = engine._adapter
    assert adapter.decode_pass is not None and adapter.dtype == torch.bfloat16
    ids = engine.tokenizer(rag_prompt(docs[:3], "Summarize.")).input_ids
    segments, lengths = _steps(adapter, ids)
    expected = _outputs(adapter.forward_packed_by_model, segments, lengths)
    got = _outputs(adapter.forward_packed, segments, lengths)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("family", ["gemma2", "phi3", "stablelm", "gpt2"])
def test_families_of_another_form_keep_the_models_pass(tokenizer, family):
    engine = _engine(tokenizer, family)
    assert engine._adapter.decode_pass is None
    assert unsupported_reason(engine.model)


def test_a_hooked_model_keeps_the_models_pass():
    model = tiny_model("llama")
    assert unsupported_reason(model) == ""
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * 2)
    assert "hooks" in unsupported_reason(model)


@torch.inference_mode()
@pytest.mark.parametrize(
    "kernel",
    ["off", pytest.param("packed", marks=pytest.mark.skipif(not small_rows.onednn_available(), reason="no oneDNN"))],
)
def test_a_hook_registered_after_load_is_called_in_decode_steps(tokenizer, docs, monkeypatch, kernel):
    if kernel == "packed":
        monkeypatch.setattr(small_rows, "PACKED_MIN_BYTES", 0)  # tiny layers take the packed copy too
        monkeypatch.setattr(small_rows, "float_kernel_min_rows", lambda vendor=None: 1)
    engine = _engine(tokenizer, "llama", small_row_kernels=kernel)
    assert (engine._adapter.small_rows.view is not None) == (kernel == "packed")
    adapter = engine._adapter
    ids = engine.tokenizer(rag_prompt(docs[:3], "Summarize.")).input_ids
    segments, lengths = _steps(adapter, ids)
    assert adapter.decode_pass.takes(segments)
    calls = []
    handle = engine.model.model.layers[2].self_attn.k_proj.register_forward_hook(lambda *args: calls.append(1))
    assert not adapter.decode_pass.takes(segments)
    _outputs(adapter.forward_packed, segments, lengths)
    assert calls == [1]
    handle.remove()
    if adapter.small_rows.view is not None:  # decode rows run the view: the model's hooks run there too
        assert adapter.decoding_model() is not engine.model
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: calls.append(2))
    try:
        assert not adapter.decode_pass.takes(segments)
    finally:
        handle.remove()
    assert adapter.decode_pass.takes(segments)


def test_the_check_at_load_refuses_a_pass_that_computes_otherwise(tokenizer, monkeypatch):
    """Granite's layers have the Llama form's modules, but its model scales the embeddings,
    each residual branch and the logits in its own forward; let through the family filter,
    the direct pass computes other logits, which the check finds. StableLM's rotation of part
    of each head fails in the direct pass, which the check also turns into the model's pass."""
    monkeypatch.setattr(decode_pass_module, "FAMILIES", decode_pass_module.FAMILIES | {"granite", "stablelm"})
    granite = tiny_model("granite", residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=2.0)
    assert unsupported_reason(granite) == ""
    engine = KVBoost.from_model(granite, tokenizer, show_progress=False)
    assert engine._adapter.decode_pass is None
    assert not decode_pass_module._same_logits(engine._adapter, DecodePass(granite, engine._adapter.small_rows))
    stablelm = tiny_model("stablelm")
    assert unsupported_reason(stablelm) == ""
    assert KVBoost.from_model(stablelm, tokenizer, show_progress=False)._adapter.decode_pass is None


@torch.inference_mode()
def test_prompt_work_in_a_step_goes_through_the_models_pass(tokenizer, monkeypatch):
    engine = _engine(tokenizer, "llama")
    adapter = engine._adapter
    ran = []
    monkeypatch.setattr(adapter.decode_pass, "run", lambda segments: ran.append(segments))
    cache, other = adapter.new_cache(12), adapter.new_cache(12)
    adapter.forward(torch.arange(3, 8), torch.arange(5), cache)
    row = Segment(torch.tensor([9]), torch.tensor([5]), cache, logits=1, decode=True)
    prefill = Segment(torch.arange(3, 7), torch.arange(4), other, logits=1)
    outputs = adapter.forward_packed([row, prefill])
    assert not ran and len(outputs) == 2 and outputs[0].logits.shape[0] == 1
    assert not adapter.decode_pass.takes([Segment(torch.arange(300), torch.arange(300), other, logits=300, decode=True)])


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_an_engines_answers_are_the_same_with_or_without_the_direct_pass(tokenizer, docs, draft_tokens):
    prompts = [rag_prompt([docs[0], docs[2]], "What does it say?"), rag_prompt([docs[1]], "Summarize.")]
    direct = _engine(tokenizer, "qwen2", draft_tokens=draft_tokens)
    through_model = _engine(tokenizer, "qwen2", draft_tokens=draft_tokens)
    through_model._adapter.decode_pass = None
    assert direct._adapter.decode_pass is not None
    for prompt in prompts:
        a = direct.generate(prompt, max_new_tokens=12, return_logits=True)
        b = through_model.generate(prompt, max_new_tokens=12, return_logits=True)
        assert a.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in zip(a.step_logits, b.step_logits))
    batch = direct.generate_batch(prompts, max_new_tokens=8)
    alone = [through_model.generate(prompt, max_new_tokens=8).token_ids for prompt in prompts]
    assert [r.token_ids for r in batch] == alone
