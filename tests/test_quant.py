"""KIVI-style quantization: error bounds, grouping axes, packing, sizes, codec round trip."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.cache import quant
from kvboost_rag.cache.codec import KVBlock, decode_block, encode_block

# SmolLM2-135M layout: 30 layers, 3 K/V heads, head_dim 64.
SMOL_LAYOUT = (30, 3, 64)


def _kv(shape: tuple[int, int, int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with a few large outlier channels (as real keys have), Gaussian values."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=gen) * 2.0
    if shape[-1] > 3:
        keys[..., 3] += 30.0
        keys[..., shape[-1] // 2] *= 8.0
    values = torch.randn(shape, generator=gen)
    return keys, values


def _key_bound(q: dict[str, torch.Tensor], tokens: int, group_size: int) -> torch.Tensor:
    """Half a key quantization step, expanded to ``[L, H, T, D]``."""
    return q["key_scale"].float().repeat_interleave(group_size, dim=2)[:, :, :tokens] / 2


def _value_bound(q: dict[str, torch.Tensor], head_dim: int, group_size: int) -> torch.Tensor:
    return q["value_scale"].float().repeat_interleave(group_size, dim=3)[..., :head_dim] / 2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    ("shape", "group_size"),
    [((2, 3, 64, 64), 32), ((2, 2, 37, 20), 32), ((1, 2, 5, 7), 4), ((3, 1, 33, 64), 16)],
)
def test_round_trip_error_is_within_half_a_step(shape, group_size, bits):
    keys, values = _kv(shape)
    q = quant.quantize_kv(keys, values, bits, group_size)
    k2, v2 = quant.dequantize_kv(q, bits, group_size, shape, torch.float32)
    assert k2.shape == keys.shape and v2.shape == values.shape
    tol = 1e-5
    assert ((k2 - keys).abs() <= _key_bound(q, shape[2], group_size) * (1 + tol) + tol).all()
    assert ((v2 - values).abs() <= _value_bound(q, shape[3], group_size) * (1 + tol) + tol).all()


@pytest.mark.parametrize(("bits", "max_rel"), [(8, 0.01), (4, 0.12)])
def test_relative_error_figures(bits, max_rel):
    shape = (30, 3, 128, 64)
    keys, values = _kv(shape, seed=1)
    q = quant.quantize_kv(keys, values, bits, 32)
    k2, v2 = quant.dequantize_kv(q, bits, 32, shape, torch.float32)
    key_rel = ((k2 - keys).norm() / keys.norm()).item()
    value_rel = ((v2 - values).norm() / values.norm()).item()
    assert key_rel < max_rel
    assert value_rel < max_rel * 4  # values have no large offset to hide the error behind
    if bits == 8:
        assert value_rel < 0.01


def test_keys_are_grouped_per_channel_so_an_outlier_channel_stays_local():
    shape = (1, 1, 32, 16)
    keys = torch.randn(shape) * 0.1
    keys[..., 0] = 1000.0 + torch.randn(32)  # one huge channel
    values = torch.zeros(shape)
    q = quant.quantize_kv(keys, values, 4, 32)
    k2, _ = quant.dequantize_kv(q, 4, 32, shape, torch.float32)
    # Per-token grouping would give every channel a step of ~1000/15; per channel, the small
    # channels keep a step of ~0.06.
    assert (k2[..., 1:] - keys[..., 1:]).abs().max() < 0.05
    assert q["key_scale"].shape == (1, 1, 1, 16)


def test_values_are_grouped_per_token_so_an_outlier_token_stays_local():
    shape = (1, 1, 8, 32)
    values = torch.randn(shape) * 0.1
    values[..., 5, :] = 500.0 + torch.randn(32)  # one huge token
    keys = torch.zeros(shape)
    q = quant.quantize_kv(keys, values, 4, 32)
    _, v2 = quant.dequantize_kv(q, 4, 32, shape, torch.float32)
    others = [t for t in range(8) if t != 5]
    assert (v2[..., others, :] - values[..., others, :]).abs().max() < 0.05
    assert q["value_scale"].shape == (1, 1, 8, 1)


def test_constant_groups_round_trip_exactly():
    shape = (2, 2, 10, 8)
    keys = torch.full(shape, 0.25)
    values = torch.full(shape, -3.0)
    for bits in (8, 4):
        q = quant.quantize_kv(keys, values, bits, 4)
        k2, v2 = quant.dequantize_kv(q, bits, 4, shape, torch.float32)
        assert torch.equal(k2, keys) and torch.equal(v2, values)


def test_ranges_beyond_float16_fall_back_to_float32_side_data():
    shape = (1, 1, 4, 8)
    keys = torch.linspace(-1e6, 1e6, 32).reshape(shape)
    values = torch.linspace(-1, 1, 32).reshape(shape)
    q = quant.quantize_kv(keys, values, 8, 4)
    assert q["key_scale"].dtype == torch.float32
    assert q["value_scale"].dtype == torch.float16
    k2, _ = quant.dequantize_kv(q, 8, 4, shape, torch.float32)
    assert ((k2 - keys).abs() <= _key_bound(q, 4, 4) * 1.0001).all()


def test_empty_block():
    shape = (2, 3, 0, 64)
    keys, values = torch.zeros(shape), torch.zeros(shape)
    for bits in (8, 4):
        q = quant.quantize_kv(keys, values, bits, 32)
        k2, v2 = quant.dequantize_kv(q, bits, 32, shape, torch.float16)
        assert k2.shape == shape and v2.dtype == torch.float16


@pytest.mark.parametrize("numel", [1, 2, 7, 64])
def test_int4_packing_round_trip(numel):
    codes = torch.randint(0, 16, (numel,), dtype=torch.uint8)
    packed = quant.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == (numel + 1) // 2
    assert torch.equal(quant.unpack_int4(packed, (numel,)), codes)


def test_int4_codes_are_packed_two_per_byte():
    shape = (2, 3, 64, 64)
    keys, values = _kv(shape)
    q8 = quant.quantize_kv(keys, values, 8, 32)
    q4 = quant.quantize_kv(keys, values, 4, 32)
    assert q8["key_codes"].shape == shape and q8["key_codes"].dtype == torch.uint8
    assert q4["key_codes"].numel() * 2 == q8["key_codes"].numel()
    assert q4["value_codes"].numel() * 2 == q8["value_codes"].numel()
    assert int(q8["key_codes"].max()) == 255 and int(q8["key_codes"].min()) == 0
    unpacked = quant.unpack_int4(q4["key_codes"], shape)
    assert int(unpacked.max()) == 15 and int(unpacked.min()) == 0


def test_bytes_per_token_for_the_default_model_layout():
    layers, heads, head_dim = SMOL_LAYOUT
    assert quant.kv_bytes_per_token(layers, heads, head_dim, bits=None) == 46080
    assert quant.kv_bytes_per_token(layers, heads, head_dim, bits=None, dtype_bytes=2) == 23040
    assert quant.kv_bytes_per_token(layers, heads, head_dim, bits=8, group_size=32) == 12960
    assert quant.kv_bytes_per_token(layers, heads, head_dim, bits=4, group_size=32) == 7200
    # The formula matches what quantize_kv actually returns for a 128-token chunk.
    tokens = 128
    keys, values = _kv((layers, heads, tokens, head_dim))
    for bits in (8, 4):
        stored = sum(t.numel() * t.element_size() for t in quant.quantize_kv(keys, values, bits, 32).values())
        assert stored == quant.kv_bytes_per_token(layers, heads, head_dim, bits=bits) * tokens


def test_dequantize_rejects_mismatched_tensors():
    shape = (2, 2, 16, 8)
    keys, values = _kv(shape)
    q = quant.quantize_kv(keys, values, 4, 8)
    with pytest.raises(ValueError, match="packed int4"):
        quant.dequantize_kv(q, 4, 8, (2, 2, 17, 8), torch.float32)
    with pytest.raises(ValueError):
        quant.dequantize_kv(q, 8, 8, shape, torch.float32)  # 4-bit codes read as 8-bit
    with pytest.raises(ValueError, match="key_scale"):
        quant.dequantize_kv(q, 4, 4, shape, torch.float32)  # wrong group size
    with pytest.raises(KeyError):
        quant.dequantize_kv({k: v for k, v in q.items() if k != "value_zero"}, 4, 8, shape, torch.float32)
    with pytest.raises(ValueError, match="bits"):
        quant.quantize_kv(keys, values, 2, 8)
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize_kv(keys, values, 8, 0)
    with pytest.raises(ValueError, match="share a 4-D shape"):
        quant.quantize_kv(keys, values[:, :, :3], 8, 8)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_round_trip_with_quantization(bits, dtype):
    layers, heads, head_dim = 3, 2, 16
    keys, values = _kv((layers, heads, 45, head_dim))
    block = KVBlock(keys.to(dtype), values.to(dtype), torch.arange(45), start_position=7)
    entry = encode_block(block, fingerprint="fp", bits=bits, group_size=16)
    assert "keys" not in entry.tensors and entry.nbytes < block.nbytes / (2 if dtype == torch.float32 else 1.2)
    out = decode_block(entry, fingerprint="fp", expected_layout=(layers, heads, head_dim))
    assert out.keys.dtype == dtype and out.keys.shape == keys.shape and out.start_position == 7
    rel = ((out.values.float() - values).norm() / values.norm()).item()
    assert rel < (0.01 if bits == 8 else 0.15)
