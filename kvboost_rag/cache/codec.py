"""K/V blocks and their conversion to and from stored entries.

A :class:`KVBlock` is the K/V of a run of tokens for every layer, with the position its first
token had when it was computed (needed to re-rotate keys to a new position). The codec turns a
block into a :class:`~kvboost_rag.cache.storage.base.StoredEntry` (optionally quantized) and back.
Decoding treats the entry as untrusted input: metadata, tensor dtypes and shapes, and the
range of the K/V are validated, and any problem raises :class:`CorruptEntryError`, which the
cache manager turns into a miss that deletes the entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvboost_rag.cache import quant
from kvboost_rag.cache.storage.base import StoredEntry

FORMAT_VERSION = "1"
#: Largest absolute K/V value accepted from a stored entry: the largest finite float16. A
#: float16 model cannot produce more, and real K/V of any dtype stay far below it (tens to
#: hundreds, a few thousand in outlier key channels); crafted values beyond it would turn into
#: infinities in 16-bit attention.
MAX_ABS_KV = 65504.0
#: Largest accepted start position or token count (positions are int32 in attention masks).
MAX_POSITION = 2**31 - 1
#: Largest accepted quantization group size.
MAX_GROUP_SIZE = 1 << 16
#: Quantization bits an entry may declare (0: not quantized).
ALLOWED_BITS = frozenset({0, *quant.SUPPORTED_BITS})
_STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_METADATA_FIELDS = frozenset({"format", "fingerprint", "start_position", "dtype", "shape", "bits"})
_UINT_RE = re.compile(r"[0-9]{1,20}", re.ASCII)


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
    metadata = _metadata(block, fingerprint, bits)
    tensors: dict[str, torch.Tensor] = {"token_ids": block.token_ids.detach().to("cpu", torch.int64).contiguous()}
    if bits is None:
        tensors["keys"] = block.keys.detach().to("cpu").contiguous()  # [L, H, tokens, D]
        tensors["values"] = block.values.detach().to("cpu").contiguous()  # [L, H, tokens, D]
    else:
        tensors.update(quant.quantize_kv(block.keys.detach().cpu(), block.values.detach().cpu(), bits, group_size))
        metadata["group_size"] = str(group_size)
    return StoredEntry(tensors=tensors, metadata=metadata)


def entry_in_place(block: KVBlock, *, fingerprint: str) -> StoredEntry:
    """An unquantized entry over ``block``'s own tensors (no copy, no move: K/V stay where
    they are, on the device or in host memory; token ids must be a host int64 tensor). It
    decodes as :func:`encode_block`'s entry does; until its tensors are copied, it is only
    valid while the memory it views is not written."""
    tensors = {"token_ids": block.token_ids, "keys": block.keys, "values": block.values}
    return StoredEntry(tensors=tensors, metadata=_metadata(block, fingerprint, None))


def _metadata(block: KVBlock, fingerprint: str, bits: int | None) -> dict[str, str]:
    """The metadata of ``block``'s entry."""
    return {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "start_position": str(block.start_position),
        "dtype": str(block.keys.dtype).removeprefix("torch."),
        "shape": ",".join(str(d) for d in block.keys.shape),
        "bits": str(bits or 0),
    }


def decode_block(
    entry: StoredEntry,
    *,
    fingerprint: str,
    expected_layout: tuple[int, int, int],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    trusted: bool = False,
) -> KVBlock:
    """Turn a stored entry back into a block, validating everything.

    Entries are untrusted input (a shared tier may hold bytes anyone wrote with a valid
    checksum): metadata is checked against an allowlist, tensors against the dtypes and
    shapes the metadata and the model's layout imply, and K/V must be finite and within
    :data:`MAX_ABS_KV`. Quantized entries are moved to ``device`` before dequantizing
    (so int8/int4 entries are dequantized on the GPU); copies from pinned memory are
    asynchronous.

    Args:
        entry: What a tier returned.
        fingerprint: The model fingerprint the caller expects.
        expected_layout: ``(layers, kv_heads, head_dim)`` of the model.
        device: Where the tensors go.
        dtype: Dtype of the returned K/V (default: the stored dtype).
        trusted: The entry comes from this process's own memory (written by it, or checked
            when it was first read from a shared tier): only the fingerprint and the K/V
            layout are checked again; no metadata is parsed again and no tensor value is read
            (no host read, so no device sync).

    Raises:
        CorruptEntryError: For every problem with the entry (never another exception type,
            except out-of-memory errors, which are not the entry's fault).
    """
    try:
        if trusted:
            return _decode_trusted(entry, fingerprint, expected_layout, device, dtype)
        return _decode(entry, fingerprint, expected_layout, device, dtype)
    except CorruptEntryError:
        raise
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError, AttributeError) as exc:
        raise CorruptEntryError(f"cannot decode entry: {type(exc).__name__}: {exc}") from exc


def _decode(
    entry: StoredEntry,
    fingerprint: str,
    expected_layout: tuple[int, int, int],
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> KVBlock:
    """Decode an untrusted entry: every metadata field, tensor dtype, shape and value checked."""
    meta = entry.metadata
    if not isinstance(meta, dict) or not isinstance(entry.tensors, dict):
        raise CorruptEntryError("entry metadata and tensors must be mappings")
    bits, stored_dtype, start, shape = _checked_metadata(meta, fingerprint, expected_layout)
    names = {"token_ids", "keys", "values"} if bits == 0 else {"token_ids", *quant.TENSOR_NAMES}
    if set(entry.tensors) != names or not all(isinstance(t, torch.Tensor) for t in entry.tensors.values()):
        raise CorruptEntryError(f"entry tensors {sorted(entry.tensors)} differ from {sorted(names)}")
    token_ids = entry.tensors["token_ids"]  # [tokens] int64
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        raise CorruptEntryError(f"token_ids must be a 1-D int64 tensor, got {token_ids.dtype} {tuple(token_ids.shape)}")
    if token_ids.shape[0] != shape[2]:
        raise CorruptEntryError("token_ids length does not match the K/V length")
    if token_ids.numel() and int(token_ids.min()) < 0:
        raise CorruptEntryError("token_ids must not be negative")
    keys, values = _kv_on_device(entry, meta, bits, shape, stored_dtype, device)  # [L, H, tokens, D] each
    if keys.numel():
        # One reduction pass per tensor and one device sync for both (NaN propagates to the
        # bounds and fails the comparison): an order of magnitude cheaper than abs() <= max.
        bounds = torch.stack([*torch.aminmax(keys), *torch.aminmax(values)]).float().tolist()
        for name, (low, high) in (("keys", bounds[:2]), ("values", bounds[2:])):
            if not -MAX_ABS_KV <= low <= high <= MAX_ABS_KV:
                raise CorruptEntryError(f"{name} hold non-finite values or values beyond +-{MAX_ABS_KV:g}")
    target = dtype or stored_dtype
    return KVBlock(keys=keys.to(dtype=target), values=values.to(dtype=target), token_ids=token_ids, start_position=start)


def _checked_metadata(
    meta: dict[str, str], fingerprint: str, expected_layout: tuple[int, int, int]
) -> tuple[int, torch.dtype, int, tuple[int, int, int, int]]:
    """``(bits, stored dtype, start position, shape)`` of well-formed metadata for this model."""
    if meta.get("format") != FORMAT_VERSION:
        raise CorruptEntryError(f"unknown entry format {_shown(meta.get('format'))}")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptEntryError("entry belongs to another model fingerprint")
    bits = _allowed_int(meta, "bits", ALLOWED_BITS)
    required = _METADATA_FIELDS | ({"group_size"} if bits else set())
    if set(meta) != required:
        raise CorruptEntryError(f"entry metadata fields {sorted(meta)} differ from {sorted(required)}")
    stored_dtype = _STORED_DTYPES.get(meta["dtype"])
    if stored_dtype is None:
        raise CorruptEntryError(f"entry dtype {_shown(meta['dtype'])} is not one of {sorted(_STORED_DTYPES)}")
    start = _int_field(meta, "start_position", 0, MAX_POSITION)
    return bits, stored_dtype, start, _shape_field(meta["shape"], expected_layout)


def _kv_on_device(
    entry: StoredEntry,
    meta: dict[str, str],
    bits: int,
    shape: tuple[int, int, int, int],
    stored_dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entry's K and V (``shape`` each) on ``device``: checked against the header, or
    dequantized there."""
    if bits == 0:
        keys, values = entry.tensors["keys"], entry.tensors["values"]
        for name, tensor in (("keys", keys), ("values", values)):
            if tensor.dtype != stored_dtype or tuple(tensor.shape) != shape:
                raise CorruptEntryError(
                    f"{name} is {str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}, "
                    f"header says {meta['dtype']} {shape}"
                )
        return keys.to(device, non_blocking=True), values.to(device, non_blocking=True)
    group_size = _int_field(meta, "group_size", 1, MAX_GROUP_SIZE)
    on_device = {name: entry.tensors[name].to(device, non_blocking=True) for name in quant.TENSOR_NAMES}
    keys, values = quant.dequantize_kv(on_device, bits, group_size, shape, stored_dtype)  # [L, H, tokens, D]
    if tuple(keys.shape) != shape or tuple(values.shape) != shape:
        raise CorruptEntryError(f"dequantized shapes differ from header {shape}")
    return keys, values


def _decode_trusted(
    entry: StoredEntry,
    fingerprint: str,
    expected_layout: tuple[int, int, int],
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> KVBlock:
    """:func:`_decode` for an entry of this process's own memory, which passed the full
    checks when it entered it: the fingerprint, the K/V names and their layout are checked
    again (a cheap guard against a mixed-up store), the metadata is not parsed again."""
    meta = entry.metadata
    if meta.get("fingerprint") != fingerprint:
        raise CorruptEntryError("entry belongs to another model fingerprint")
    bits = int(meta["bits"])
    stored_dtype = _STORED_DTYPES[meta["dtype"]]
    if bits == 0:
        keys, values = entry.tensors["keys"], entry.tensors["values"]
        keys, values = keys.to(device, non_blocking=True), values.to(device, non_blocking=True)
    else:
        shape = _shape_field(meta["shape"], expected_layout)
        on_device = {name: entry.tensors[name].to(device, non_blocking=True) for name in quant.TENSOR_NAMES}
        keys, values = quant.dequantize_kv(on_device, bits, int(meta["group_size"]), shape, stored_dtype)
    layers, heads, head_dim = expected_layout
    token_ids = entry.tensors["token_ids"]  # [tokens] int64, on the host
    if keys.dim() != 4 or (keys.shape[0], keys.shape[1], keys.shape[3]) != (layers, heads, head_dim):
        raise CorruptEntryError(f"entry shape {tuple(keys.shape)} does not fit layout {expected_layout}")
    if values.shape != keys.shape or token_ids.shape != (keys.shape[2],):
        raise CorruptEntryError("entry K, V and token ids disagree in length")
    target = dtype or stored_dtype
    return KVBlock(
        keys=keys.to(dtype=target),
        values=values.to(dtype=target),
        token_ids=token_ids,
        start_position=int(meta["start_position"]),
    )


def _shown(value: object) -> str:
    """A short, printable rendering of an untrusted metadata value for messages."""
    return ascii(value)[:40]


def _int_field(meta: dict[str, str], name: str, low: int, high: int) -> int:
    """A metadata field holding a plain decimal integer within ``[low, high]``."""
    text = meta.get(name)
    if not isinstance(text, str) or not _UINT_RE.fullmatch(text):
        raise CorruptEntryError(f"entry field {name} = {_shown(text)} is not a non-negative integer")
    value = int(text)
    if not low <= value <= high:
        raise CorruptEntryError(f"entry field {name} = {value} is outside [{low}, {high}]")
    return value


def _allowed_int(meta: dict[str, str], name: str, allowed: frozenset[int]) -> int:
    value = _int_field(meta, name, 0, max(allowed))
    if value not in allowed:
        raise CorruptEntryError(f"entry field {name} = {value} is not one of {sorted(allowed)}")
    return value


def _shape_field(text: str, expected_layout: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """``layers,kv_heads,tokens,head_dim`` that fits ``expected_layout``."""
    parts = text.split(",") if isinstance(text, str) else []
    if len(parts) != 4 or not all(_UINT_RE.fullmatch(p) for p in parts):
        raise CorruptEntryError(f"entry shape {_shown(text)} is not four non-negative integers")
    shape = tuple(int(p) for p in parts)
    layers, heads, head_dim = expected_layout
    if (shape[0], shape[1], shape[3]) != (layers, heads, head_dim) or shape[2] > MAX_POSITION:
        raise CorruptEntryError(f"entry shape {shape} does not fit layout {expected_layout}")
    return shape  # type: ignore[return-value]
