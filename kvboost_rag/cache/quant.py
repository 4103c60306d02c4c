"""KIVI-style K/V quantization as pure tensor functions.

Keys have a few outlier channels whose magnitude stays the same across tokens, so keys are
quantized **per channel**: each channel of each ``group_size``-token span gets its own scale
and zero point. Values have no such channel structure but mix along the token axis in
attention, so values are quantized **per token**: each token's ``head_dim`` channels are cut
into ``group_size``-channel groups with a scale and zero point each (Liu et al., 2024, "KIVI").

Quantization is asymmetric min/max: ``code = round((x - zero) / scale)`` with ``zero`` the
group minimum (rounded down to float16) and ``scale = (max - zero) / (2**bits - 1)`` (rounded
up to float16), so every code fits ``[0, 2**bits - 1]`` and the round-trip error of an
element is at most half its group's ``scale``. Scales and zero points are stored as float16
(float32 for a tensor whose ranges do not fit float16). 4-bit codes are packed two per byte.

Token counts and ``head_dim`` need not be multiples of ``group_size``: the last group is
padded internally by repeating its last element (which leaves its min/max unchanged) and the
padding is cut off before storing.

Layout of ``keys``/``values``: ``[layers, kv_heads, tokens, head_dim]``.
"""

from __future__ import annotations

from typing import Protocol

import torch

SUPPORTED_BITS = (4, 8)

#: Names of the tensors :func:`quantize_kv` returns.
TENSOR_NAMES = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")

_SCALE_BYTES = 2  # float16 scale
_ZERO_BYTES = 2  # float16 zero point


def quantize_kv(keys: torch.Tensor, values: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """Quantize one block's keys per channel and values per token.

    Args:
        keys: ``[layers, kv_heads, tokens, head_dim]`` floating point.
        values: Same shape as ``keys``.
        bits: 8 or 4.
        group_size: Tokens per key group and channels per value group.

    Returns:
        ``key_codes``, ``key_scale``, ``key_zero``, ``value_codes``, ``value_scale``,
        ``value_zero``, on the device of ``keys``. Codes are ``uint8`` (``[layers, kv_heads, tokens,
        head_dim]`` at 8 bits, a flat packed vector at 4 bits); key scales/zeros are
        ``[layers, kv_heads, ceil(tokens / group_size), head_dim]`` and value scales/zeros
        ``[layers, kv_heads, tokens, ceil(head_dim / group_size)]``.

    Raises:
        ValueError: Unsupported ``bits``, non-positive ``group_size``, or ``keys`` and
            ``values`` not of the same 4-D shape.
    """
    _check_args(bits, group_size)
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(f"keys and values must share a 4-D shape, got {tuple(keys.shape)} and {tuple(values.shape)}")
    key_codes, key_scale, key_zero = quantize_per_channel(keys, bits, group_size)
    value_codes, value_scale, value_zero = quantize_per_token(values, bits, group_size)
    if bits == 4:
        key_codes, value_codes = pack_int4(key_codes), pack_int4(value_codes)
    return {
        "key_codes": key_codes,
        "key_scale": key_scale,
        "key_zero": key_zero,
        "value_codes": value_codes,
        "value_scale": value_scale,
        "value_zero": value_zero,
    }


def dequantize_kv(
    tensors: dict[str, torch.Tensor],
    bits: int,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild keys and values from :func:`quantize_kv` output.

    Args:
        tensors: The quantized tensors (other entries in the dict are ignored).
        bits: The bits they were quantized with.
        group_size: The group size they were quantized with.
        shape: Original ``(layers, kv_heads, tokens, head_dim)``.
        dtype: Dtype of the returned tensors.

    Returns:
        ``(keys, values)`` of ``shape`` and ``dtype``, on the device of the codes.

    Raises:
        KeyError: A tensor is missing.
        ValueError: Arguments or tensor shapes/dtypes do not fit ``shape``.
    """
    _check_args(bits, group_size)
    if len(shape) != 4 or any(d < 0 for d in shape):
        raise ValueError(f"shape must be 4 non-negative sizes, got {shape}")
    shape = tuple(int(d) for d in shape)
    key_codes, value_codes = tensors["key_codes"], tensors["value_codes"]
    if bits == 4:
        key_codes, value_codes = unpack_int4(key_codes, shape), unpack_int4(value_codes, shape)
    _expect(key_codes, shape, torch.uint8, "key_codes")
    _expect(value_codes, shape, torch.uint8, "value_codes")
    keys = dequantize_per_channel(key_codes, tensors["key_scale"], tensors["key_zero"], group_size)
    values = dequantize_per_token(value_codes, tensors["value_scale"], tensors["value_zero"], group_size)
    return keys.to(dtype).contiguous(), values.to(dtype).contiguous()


def quantize_per_channel(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``[..., tokens, channels]`` with one scale/zero per channel per token group.

    Returns:
        ``(codes [..., tokens, channels] uint8, scale, zero)`` with scale/zero of shape
        ``[..., ceil(tokens / group_size), channels]``.
    """
    *lead, tokens, channels = x.shape
    groups = _num_groups(tokens, group_size)
    padded = _pad_repeat_last(x.detach().float(), dim=-2, size=groups * group_size)
    grouped = padded.reshape(*lead, groups, group_size, channels)  # [..., G, gs, C]
    codes, scale, zero = _minmax_quantize(grouped, dim=-2, bits=bits)
    codes = codes.reshape(*lead, groups * group_size, channels)[..., :tokens, :]
    return codes.contiguous(), scale.squeeze(-2).contiguous(), zero.squeeze(-2).contiguous()


def dequantize_per_channel(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_per_channel` (float32)."""
    *lead, tokens, channels = codes.shape
    groups = _num_groups(tokens, group_size)
    expected = (*lead, groups, channels)
    _expect(scale, expected, None, "key_scale")
    _expect(zero, expected, None, "key_zero")
    padded = _pad_zeros(codes, dim=-2, size=groups * group_size)
    grouped = padded.reshape(*lead, groups, group_size, channels).float()
    out = torch.addcmul(zero.float().unsqueeze(-2), grouped, scale.float().unsqueeze(-2))
    return out.reshape(*lead, groups * group_size, channels)[..., :tokens, :]


def quantize_per_token(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``[..., channels]`` with one scale/zero per ``group_size`` channels of each row.

    Returns:
        ``(codes [..., channels] uint8, scale, zero)`` with scale/zero of shape
        ``[..., ceil(channels / group_size)]``.
    """
    *lead, channels = x.shape
    groups = _num_groups(channels, group_size)
    padded = _pad_repeat_last(x.detach().float(), dim=-1, size=groups * group_size)
    grouped = padded.reshape(*lead, groups, group_size)  # [..., G, gs]
    codes, scale, zero = _minmax_quantize(grouped, dim=-1, bits=bits)
    codes = codes.reshape(*lead, groups * group_size)[..., :channels]
    return codes.contiguous(), scale.squeeze(-1).contiguous(), zero.squeeze(-1).contiguous()


def dequantize_per_token(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token` (float32)."""
    *lead, channels = codes.shape
    groups = _num_groups(channels, group_size)
    expected = (*lead, groups)
    _expect(scale, expected, None, "value_scale")
    _expect(zero, expected, None, "value_zero")
    padded = _pad_zeros(codes, dim=-1, size=groups * group_size)
    grouped = padded.reshape(*lead, groups, group_size).float()
    out = torch.addcmul(zero.float().unsqueeze(-1), grouped, scale.float().unsqueeze(-1))
    return out.reshape(*lead, groups * group_size)[..., :channels]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (``uint8`` in ``[0, 15]``) two per byte into a flat ``uint8`` vector.

    The element at even flat index ``2i`` goes into the low nibble of byte ``i``, the next one
    into the high nibble; an odd count gets a zero high nibble in the last byte.
    """
    flat = codes.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_int4`.

    Raises:
        ValueError: ``packed`` is not a flat ``uint8`` vector of the size ``shape`` needs.
    """
    numel = 1
    for d in shape:
        numel *= d
    _expect(packed, ((numel + 1) // 2,), torch.uint8, "packed int4 codes")
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)
    return out[:numel].reshape(shape)


def kv_bytes_per_token(
    layers: int,
    kv_heads: int,
    head_dim: int,
    *,
    bits: int | None,
    group_size: int = 32,
    dtype_bytes: int = 4,
) -> float:
    """Stored bytes of one token's K and V across all layers (asymptotic, long blocks).

    Args:
        layers: Model layers.
        kv_heads: K/V heads per layer.
        head_dim: Channels per head.
        bits: 8 or 4 for quantized K/V, ``None`` for unquantized.
        group_size: Quantization group size.
        dtype_bytes: Bytes per element when unquantized (4 for float32, 2 for 16-bit).

    Returns:
        Bytes per token, counting codes plus float16 scales and zero points.
    """
    elements = 2 * layers * kv_heads * head_dim  # keys and values
    if bits is None:
        return float(elements * dtype_bytes)
    _check_args(bits, group_size)
    key_groups_per_token = head_dim / group_size  # one (scale, zero) per channel per group_size tokens
    value_groups_per_token = _num_groups(head_dim, group_size)  # per token: ceil(head_dim / group_size)
    side = (_SCALE_BYTES + _ZERO_BYTES) * layers * kv_heads * (key_groups_per_token + value_groups_per_token)
    return elements * bits / 8 + side


class TokenLayout(Protocol):
    """The shape of one token's K/V (a :class:`~kvboost_rag.cache.codec.KVLayout`)."""

    @property
    def layers(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def unquantized_kv_bytes_per_token(layout: TokenLayout, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V across all layers of ``layout`` in ``dtype`` (buffers a
    prompt or a captured slot holds: never quantized)."""
    element = torch.empty((), dtype=dtype).element_size()
    return int(kv_bytes_per_token(layout.layers, layout.kv_heads, layout.head_dim, bits=None, dtype_bytes=element))


def _minmax_quantize(grouped: torch.Tensor, *, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization reducing over ``dim`` (kept as size 1 in scale/zero)."""
    levels = (1 << bits) - 1
    low = grouped.amin(dim=dim, keepdim=True)
    high = grouped.amax(dim=dim, keepdim=True)
    zero = _to_half(low, round_up=False)
    scale = _to_half((high - zero.float()) / levels, round_up=True)
    if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        # Range does not fit float16: keep float32 side data for this tensor.
        zero = low
        scale = (high - low) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (grouped - zero.float()).mul_(scale.float().reciprocal()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def _to_half(x: torch.Tensor, *, round_up: bool) -> torch.Tensor:
    """Round float32 ``x`` to float16 towards +inf (``round_up``) or -inf."""
    half = x.to(torch.float16)
    wrong = half.float() < x if round_up else half.float() > x
    if wrong.any():
        target = torch.tensor(float("inf") if round_up else float("-inf"), dtype=torch.float16, device=half.device)
        half = torch.where(wrong, torch.nextafter(half, target.expand_as(half)), half)
    return half


def _pad_repeat_last(x: torch.Tensor, *, dim: int, size: int) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to ``size`` by repeating its last slice."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    if x.shape[dim] == 0:
        pad_shape = list(x.shape)
        pad_shape[dim] = missing
        return x.new_zeros(pad_shape)
    reps = [1] * x.dim()
    reps[dim] = missing
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.repeat(reps)], dim=dim)


def _pad_zeros(x: torch.Tensor, *, dim: int, size: int) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to ``size`` with zeros (no copy when already that size)."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = missing
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def _num_groups(length: int, group_size: int) -> int:
    return max(1, -(-length // group_size))


def _check_args(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")


def _expect(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if dtype is None and not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")
