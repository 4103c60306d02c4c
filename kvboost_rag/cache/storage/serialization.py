"""Stored entries to bytes and back: safetensors payload behind a checksummed header.

Layout of a serialized entry::

    magic    4 bytes   b"KVBE"
    version  4 bytes   little-endian uint32: 1 = checksummed, 2 = authenticated
    length   8 bytes   little-endian uint64, byte length of the payload
    digest  32 bytes   version 1: SHA-256 of the payload; version 2: HMAC-SHA256, under the
                       secret key, of magic + version + length + payload
    payload            safetensors bytes; entry metadata lives in the safetensors header

No pickle anywhere: safetensors stores raw tensor bytes with a JSON header. A flipped byte,
a truncated or padded blob, a wrong checksum, an unknown version, or an entry stored under
another key raises :class:`CorruptPayloadError`, which every tier turns into a miss.

With a secret key (tiers shared with processes you do not fully trust), entries are written
as version 2 and only version-2 entries whose MAC verifies under that key are read: an entry
written without the key or with another key is rejected like a damaged one. A reader without
a key rejects version-2 entries, which it cannot verify. Error messages never quote the bytes
read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from kvboost_rag.cache.storage.base import StoredEntry

MAGIC = b"KVBE"
#: Version of checksummed entries (SHA-256 digest).
VERSION = 1
#: Version of entries authenticated with a secret key (HMAC-SHA256 digest).
AUTHENTICATED_VERSION = 2
_HEADER = struct.Struct("<4sIQ32s")
_PREFIX = struct.Struct("<4sIQ")
#: Bytes before the payload.
HEADER_SIZE = _HEADER.size
#: Metadata field holding the cache key the entry was written under.
KEY_FIELD = "__kvboost_key__"


class CorruptPayloadError(ValueError):
    """Serialized bytes are damaged, truncated, of an unknown format or under the wrong key.

    Tiers catch it and answer a miss; it never reaches the cache manager.
    """


def serialize_entry(entry: StoredEntry, *, key: str | None = None, secret_key: bytes | None = None) -> bytes:
    """Serialize an entry to bytes.

    Args:
        entry: The entry (tensors are copied to CPU; non-contiguous or storage-sharing
            tensors are made independent first).
        key: Cache key to record inside the bytes; :func:`deserialize_entry` can check it so
            an entry copied under another name is not served.
        secret_key: Authenticate the entry with HMAC-SHA256 under this key (version 2)
            instead of a plain checksum.

    Returns:
        Header plus safetensors payload.

    Raises:
        ValueError: Metadata uses the reserved key field.
    """
    header, payload = serialize_parts(entry, key=key, secret_key=secret_key)
    return header + payload


def serialize_parts(entry: StoredEntry, *, key: str | None = None, secret_key: bytes | None = None) -> tuple[bytes, bytes]:
    """Like :func:`serialize_entry`, returning ``(header, payload)`` unjoined.

    A writer that can write the two parts one after the other (a file) saves a copy of the
    payload this way.
    """
    if KEY_FIELD in entry.metadata:
        raise ValueError(f"metadata field {KEY_FIELD!r} is reserved")
    metadata = dict(entry.metadata)
    if key is not None:
        metadata[KEY_FIELD] = key
    payload = _st_save(_independent_cpu_tensors(entry.tensors), metadata=metadata)
    version = VERSION if secret_key is None else AUTHENTICATED_VERSION
    digest = _digest(version, len(payload), payload, secret_key)
    return _HEADER.pack(MAGIC, version, len(payload), digest), payload


def deserialize_entry(
    data: bytes | bytearray | memoryview, *, expected_key: str | None = None, secret_key: bytes | None = None
) -> StoredEntry:
    """Parse bytes written by :func:`serialize_entry`, verifying everything.

    Args:
        data: Serialized entry.
        expected_key: When given, the key recorded in the bytes must equal it.
        secret_key: When given, the entry must be authenticated under this key; when
            ``None``, authenticated entries are rejected (they cannot be verified).

    Returns:
        The entry, with CPU tensors.

    Raises:
        CorruptPayloadError: Bad magic, version, length, checksum or MAC, safetensors payload
            or key.
    """
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise CorruptPayloadError(f"entry has {len(view)} bytes, shorter than its {HEADER_SIZE}-byte header")
    return deserialize_parts(
        view[:HEADER_SIZE], view[HEADER_SIZE:].tobytes(), expected_key=expected_key, secret_key=secret_key
    )


def payload_length(header: bytes | memoryview) -> int:
    """Payload bytes announced by an entry header, after checking its size, magic and version.

    Lets a reader bound how much it reads before reading it.

    Raises:
        CorruptPayloadError: The header is short or not an entry header.
    """
    return _parse_header(header)[1]


def deserialize_parts(
    header: bytes | memoryview, payload: bytes, *, expected_key: str | None = None, secret_key: bytes | None = None
) -> StoredEntry:
    """Like :func:`deserialize_entry` for a blob already split after its ``HEADER_SIZE`` bytes.

    A reader that gets the header and the payload as separate reads (a file) saves a copy of
    the payload this way.

    Raises:
        CorruptPayloadError: As :func:`deserialize_entry`.
    """
    version, length, digest = _parse_header(header)
    if len(payload) != length:
        raise CorruptPayloadError(f"payload has {len(payload)} bytes, header says {length} (truncated or padded)")
    if secret_key is None and version == AUTHENTICATED_VERSION:
        raise CorruptPayloadError("entry is authenticated with a secret key; set the same cache_secret_key to read it")
    if secret_key is not None and version != AUTHENTICATED_VERSION:
        raise CorruptPayloadError("entry is not authenticated but a cache secret key is set")
    if not hmac.compare_digest(_digest(version, length, payload, secret_key), digest):
        if secret_key is None:
            raise CorruptPayloadError("checksum mismatch")
        raise CorruptPayloadError("MAC mismatch: written with another secret key or tampered")
    try:
        metadata = _safetensors_metadata(payload)
        tensors = _st_load(payload)
    except (SafetensorError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        # The exception text may quote header bytes: name the exception only.
        raise CorruptPayloadError(f"unreadable safetensors payload ({type(exc).__name__})") from exc
    stored_key = metadata.pop(KEY_FIELD, None)
    if expected_key is not None and stored_key != expected_key:
        raise CorruptPayloadError("entry was written under another key")
    return StoredEntry(tensors=tensors, metadata=metadata)


def _parse_header(header: bytes | memoryview) -> tuple[int, int, bytes]:
    """``(version, payload length, digest)`` of an entry header."""
    if len(header) != HEADER_SIZE:
        raise CorruptPayloadError(f"entry header has {len(header)} bytes, expected {HEADER_SIZE}")
    magic, version, length, digest = _HEADER.unpack(header)
    if magic != MAGIC:
        raise CorruptPayloadError("bad magic (not a kvboost entry)")
    if version not in (VERSION, AUTHENTICATED_VERSION):
        raise CorruptPayloadError(f"unsupported entry version {version}")
    return version, length, digest


def _digest(version: int, length: int, payload: bytes, secret_key: bytes | None) -> bytes:
    """SHA-256 of the payload, or with a key its HMAC-SHA256 covering the header fields too."""
    if secret_key is None:
        return hashlib.sha256(payload).digest()
    mac = hmac.new(secret_key, _PREFIX.pack(MAGIC, version, length), hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def _safetensors_metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` dict of a safetensors blob (header: u64 length + JSON)."""
    if len(payload) < 8:
        raise ValueError("safetensors payload shorter than its length prefix")
    (header_len,) = struct.unpack_from("<Q", payload, 0)
    if header_len > len(payload) - 8:
        raise ValueError("safetensors header length exceeds payload")
    header = json.loads(payload[8 : 8 + header_len])
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata is not a str -> str mapping")
    return dict(metadata)


def _independent_cpu_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that share no storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and (ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if t.numel():
            seen.add(ptr)
        out[name] = t
    return out
