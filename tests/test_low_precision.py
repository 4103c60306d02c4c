"""Exact paths in bfloat16 and float16 (the dtypes GPU users run), on tiny models on the CPU,
and in bfloat16 on CUDA (the dtype ``from_pretrained`` picks there).

In 16-bit the prefix-hit path and full prefill round differently (attention over a cached
prefix versus one causal call), so logits agree only to 16-bit tolerance. Every decoding
step is compared teacher-forced along full prefill's tokens, and the free greedy tokens must
agree wherever full prefill's top-1 margin exceeds that tolerance: at a near tie, rounding on
another CPU kernel path or GPU picks either token with or without reuse
(:mod:`decoding_checks`).
"""

import pytest
import torch
from decoding_checks import check_against_full_prefill
from devices import device_params, engine_device_settings
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import ROPE_FAMILIES, tiny_model
from kvboost_rag.attention_backends.sparse import BACKENDS, use_backend

DTYPES = [torch.bfloat16, torch.float16]
#: ``(device, dtype)``: both 16-bit dtypes on the CPU, bfloat16 on CUDA.
DEVICE_DTYPES = device_params(cpu=DTYPES, cuda=[torch.bfloat16])
#: Logit tolerance relative to the largest logit magnitude (bfloat16 keeps 8 mantissa bits).
RELATIVE_TOL = {torch.bfloat16: 0.05, torch.float16: 0.01}


def engine_in(tokenizer, family: str, dtype: torch.dtype, device: str = "cpu", **settings) -> KVBoost:
    settings.setdefault("show_progress", False)
    settings.setdefault("chunk_size", 32)
    return KVBoost.from_model(tiny_model(family, dtype=dtype), tokenizer, **engine_device_settings(device), **settings)


def assert_close_16bit(full: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> None:
    scale = full.abs().max()
    diff = (full - other).abs().max()
    assert diff <= RELATIVE_TOL[dtype] * scale, f"max diff {diff:.3g} of max logit {scale:.3g}"


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("family", [*ROPE_FAMILIES, "gpt2"])
def test_prefix_hit_same_greedy_tokens_in_16bit(tokenizer, docs, family, device, dtype):
    engine = engine_in(tokenizer, family, dtype, device)
    assert engine.model.dtype == dtype and engine.model.device.type == device
    prefix = rag_prompt(docs[:3], question="")[: -len("\nAnswer:")]
    warm = engine.warm(prefix)
    prompt = prefix + "What is described first?\nAnswer:"
    full = engine.generate(prompt, max_new_tokens=6, reuse=False, return_logits=True)
    check = check_against_full_prefill(engine, prompt, full, rtol=RELATIVE_TOL[dtype])
    for hit in (check.forced, check.free):
        assert hit.prefix_hit_tokens >= warm.num_tokens - 1 and hit.strategy == "exact"
        assert_close_16bit(full.first_token_logits, hit.first_token_logits, dtype)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
@pytest.mark.parametrize("strategy", ["cacheblend", "attention"])
@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_cacheblend_full_ratio_same_greedy_tokens_in_16bit(tokenizer, docs, family, device, dtype, strategy):
    engine = engine_in(tokenizer, family, dtype, device, recompute_ratio=1.0, recompute_strategy=strategy)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    prompt = rag_prompt([docs[2], docs[0], docs[3], docs[1]])
    full = engine.generate(prompt, max_new_tokens=5, reuse=False, return_logits=True)
    check = check_against_full_prefill(engine, prompt, full, rtol=RELATIVE_TOL[dtype])
    for blended in (check.forced, check.free):
        assert blended.strategy == strategy
        assert blended.content_hit_tokens > 0 and blended.recomputed_tokens == blended.content_hit_tokens
        assert_close_16bit(full.first_token_logits, blended.first_token_logits, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_every_attention_backend_keeps_exact_paths_exact(make_engine, docs, family, backend, device):
    """Ratio 1.0 and a prefix hit equal full prefill (float32, tight tolerance) whichever
    backend runs the sparse attention (on CUDA, FlexAttention compiled); Gemma 2 adds
    sliding-window layers and softcapping."""
    blend_engine = make_engine(family, recompute_ratio=1.0)
    blend_engine.warm(SYSTEM_PROMPT)
    blend_engine.warm_documents(docs[:3])
    prompt = rag_prompt([docs[1], docs[2], docs[0]])
    prefix_engine = make_engine(family)
    prefix = prompt[: len(prompt) // 2]
    prefix_engine.warm(prefix)
    full = blend_engine.generate(prompt, max_new_tokens=4, reuse=False, return_logits=True)
    with use_backend(backend):
        blended = check_against_full_prefill(blend_engine, prompt, full, atol=1e-4)
        hit = check_against_full_prefill(prefix_engine, prompt, full, atol=1e-4)
    for result in (blended.forced, blended.free):
        assert result.recomputed_tokens == result.content_hit_tokens > 0
    for result in (hit.forced, hit.free):
        assert result.strategy == "exact" and result.prefix_hit_tokens >= prefix_engine.count_tokens(prefix) - 1
    for result in (blended.forced, blended.free, hit.forced, hit.free):
        assert torch.allclose(full.first_token_logits, result.first_token_logits, atol=1e-4, rtol=0)
