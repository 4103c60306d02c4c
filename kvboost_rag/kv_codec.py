"""K/V blocks and their conversion to and from stored entries.

A :class:`KVBlock` is the K/V of a run of tokens for every layer, with the position its first
token had when it was computed (needed to re-rotate keys to a new position). The codec turns a
block into a :class:`~kvboost_rag.storage.base.StoredEntry` (optionally quantized) and back,
checking shapes so a malformed entry is rejected instead of served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_rag.storage.base import StoredEntry

FORMAT_VERSION = "1"


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K/V: ``layers x kv_heads x head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int

    def as_tuple(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``."""
        return self.layers, self.kv_heads, self.head_dim


@dataclass(frozen=True)
class KVBlock:
    """K/V of consecutive tokens across all layers.

    Attributes:
        keys: ``[layers, kv_heads, tokens, head_dim]``.
        values: ``[layers, kv_heads, tokens, head_dim]``.
        token_ids: ``[tokens]`` int64, the tokens the K/V belong to.
        start_position: Position of the first token when the K/V was computed.
    """

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor
    start_position: int

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the block."""
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of K and V."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class CorruptEntryError(ValueError):
    """A stored entry does not decode to a well-formed block for this model."""


def encode_block(block: KVBlock, *, fingerprint: str, bits: int | None = None, group_size: int = 32) -> StoredEntry:
    """Turn a block into a stored entry.

    Args:
        block: The K/V to store (any device; stored on CPU).
        fingerprint: Model fingerprint the entry belongs to; checked on decode.
        bits: 8 or 4 to quantize K/V, ``None`` to keep the dtype.
        group_size: Quantization group size.

    Returns:
        The entry to hand to a storage tier.
    """
    metadata = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "start_position": str(block.start_position),
        "dtype": str(block.keys.dtype).removeprefix("torch."),
        "shape": ",".join(str(d) for d in block.keys.shape),
        "bits": str(bits or 0),
    }
    tensors: dict[str, torch.Tensor] = {"token_ids": block.token_ids.detach().to("cpu", torch.int64).contiguous()}
    if bits is None:
        tensors["keys"] = block.keys.detach().to("cpu").contiguous()
        tensors["values"] = block.values.detach().to("cpu").contiguous()
    else:
        from kvboost_rag import quant

        tensors.update(quant.quantize_kv(block.keys.detach().cpu(), block.values.detach().cpu(), bits, group_size))
        metadata["group_size"] = str(group_size)
    return StoredEntry(tensors=tensors, metadata=metadata)


def decode_block(
    entry: StoredEntry,
    *,
    fingerprint: str,
    expected_layout: tuple[int, int, int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> KVBlock:
    """Turn a stored entry back into a block, validating everything.

    Args:
        entry: What a tier returned.
        fingerprint: The model fingerprint the caller expects.
        expected_layout: ``(layers, kv_heads, head_dim)`` of the model.
        device: Where the tensors go.
        dtype: Dtype of the returned K/V (default: the stored dtype).

    Raises:
        CorruptEntryError: Wrong fingerprint, format, shapes or missing tensors.
    """
    meta = entry.metadata
    if meta.get("format") != FORMAT_VERSION:
        raise CorruptEntryError(f"unknown entry format {meta.get('format')!r}")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptEntryError("entry belongs to another model fingerprint")
    try:
        start = int(meta["start_position"])
        shape = tuple(int(d) for d in meta["shape"].split(","))
        bits = int(meta.get("bits", "0"))
        stored_dtype = getattr(torch, meta["dtype"])
        token_ids = entry.tensors["token_ids"]
    except (KeyError, ValueError, AttributeError) as exc:
        raise CorruptEntryError(f"malformed entry metadata: {exc}") from exc
    layers, heads, head_dim = expected_layout
    if len(shape) != 4 or (shape[0], shape[1], shape[3]) != (layers, heads, head_dim):
        raise CorruptEntryError(f"entry shape {shape} does not fit layout {expected_layout}")
    if token_ids.dim() != 1 or token_ids.shape[0] != shape[2]:
        raise CorruptEntryError("token_ids length does not match the K/V length")
    if bits == 0:
        try:
            keys, values = entry.tensors["keys"], entry.tensors["values"]
        except KeyError as exc:
            raise CorruptEntryError(f"missing tensor {exc}") from exc
    else:
        from kvboost_rag import quant

        try:
            keys, values = quant.dequantize_kv(entry.tensors, bits, int(meta["group_size"]), shape, stored_dtype)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise CorruptEntryError(f"cannot dequantize entry: {exc}") from exc
    if tuple(keys.shape) != shape or tuple(values.shape) != shape:
        raise CorruptEntryError(f"tensor shapes {tuple(keys.shape)}/{tuple(values.shape)} differ from header {shape}")
    target = dtype or stored_dtype
    return KVBlock(
        keys=keys.to(device=device, dtype=target),
        values=values.to(device=device, dtype=target),
        token_ids=token_ids.to(torch.int64),
        start_position=start,
    )
