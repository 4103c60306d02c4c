"""Cache keys: prefix-chained hashes for shared beginnings, content hashes for documents.

Pure functions over token ids and text (standard library and NumPy). Every key is namespaced by a model
fingerprint, so a store shared by several models never serves one model's K/V to another.

- ``prefix_hash``: SHA-256 chain. The key of a chunk covers the chunk's tokens *and* every
  token before it (through the parent hash), because its K/V depends on all of them.
- ``content_hash``: SHA-256 over a document chunk's tokens, chained within the document from
  its first token only: the same document hits wherever it lands in a prompt.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterable, Sequence

import numpy as np

_PREFIX_DOMAIN = b"kvboost-rag/prefix/v1"
_CONTENT_DOMAIN = b"kvboost-rag/content/v1"


def _pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int64 bytes (a NumPy array without a Python loop)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype("<i8", copy=False).tobytes()
    return struct.pack(f"<{len(tokens)}q", *tokens)


def root_hash(fingerprint: str, domain: bytes = _PREFIX_DOMAIN) -> str:
    """The seeded root of a hash chain for one model fingerprint."""
    return hashlib.sha256(domain + b"\0" + fingerprint.encode()).hexdigest()


def prefix_hash(parent: str, tokens: Sequence[int] | np.ndarray) -> str:
    """Key of a prefix chunk given the key of everything before it.

    Args:
        parent: ``root_hash(fingerprint)`` for the first chunk, else the previous chunk's key.
        tokens: The chunk's token ids (a sequence or an int64 array: the same key).
    """
    digest = hashlib.sha256(bytes.fromhex(parent))
    digest.update(struct.pack("<q", len(tokens)))
    digest.update(_pack_tokens(tokens))
    return digest.hexdigest()


def content_hash(fingerprint: str, tokens: Sequence[int], previous: str | None = None) -> str:
    """Key of a document chunk.

    Args:
        fingerprint: Model fingerprint (namespace).
        tokens: The chunk's token ids.
        previous: Key of the document's preceding chunk, ``None`` for its first chunk.
    """
    digest = hashlib.sha256(bytes.fromhex(previous) if previous else root_hash(fingerprint, _CONTENT_DOMAIN).encode())
    digest.update(struct.pack("<q", len(tokens)))
    digest.update(_pack_tokens(tokens))
    return digest.hexdigest()


def content_hash_chain(fingerprint: str, chunks: Iterable[Sequence[int]]) -> list[str]:
    """Keys of a document's consecutive chunks (the grid starts at the document's first token)."""
    keys: list[str] = []
    previous: str | None = None
    for chunk in chunks:
        previous = content_hash(fingerprint, chunk, previous)
        keys.append(previous)
    return keys


def text_digest(text: str) -> str:
    """SHA-256 hex digest of a string (document identity in the registry)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


#: Base of the anchor hash: an odd 64-bit constant, so it has an inverse modulo 2**64.
_ANCHOR_BASE = 0x9E3779B97F4A7C15
_ANCHOR_BASE_INVERSE = pow(_ANCHOR_BASE, -1, 1 << 64)
_MASK64 = (1 << 64) - 1


def anchor_hash(anchor: str) -> int:
    """Stable 32-bit hash of a document's first characters (the same in every process).

    The polynomial ``sum(ord(c_k) * B**k) mod 2**64`` over the characters' code points, high 32
    bits: :func:`window_anchors` computes it for every window of a prompt at once. Indexes
    documents by where they start; a hit is always confirmed against the text, so a collision
    costs one extra comparison, never a wrong match.
    """
    value, power = 0, 1
    for char in anchor:
        value = (value + ord(char) * power) & _MASK64
        power = (power * _ANCHOR_BASE) & _MASK64
    return value >> 32


def window_anchors(text: str, width: int) -> np.ndarray:
    """:func:`anchor_hash` of every ``width``-character window of ``text``, vectorized.

    Rolling sums modulo ``2**64`` (NumPy's unsigned arithmetic wraps): window ``i`` is the
    difference of two prefix sums times the inverse of ``B**i``.

    Returns:
        ``[len(text) - width + 1]`` int64 array (empty when ``text`` is shorter than ``width``).
    """
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    count = len(codes) - width + 1
    if count <= 0 or width <= 0:
        return np.empty(0, dtype=np.int64)
    powers, inverses = _anchor_powers(len(codes))
    with np.errstate(over="ignore"):
        sums = np.zeros(len(codes) + 1, dtype=np.uint64)
        np.cumsum(codes * powers[: len(codes)], dtype=np.uint64, out=sums[1:])
        windows = (sums[width:] - sums[:-width]) * inverses[:count]
    return (windows >> np.uint64(32)).astype(np.int64)


_powers_lock = threading.Lock()
_powers: tuple[np.ndarray, np.ndarray] = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))


def _anchor_powers(length: int) -> tuple[np.ndarray, np.ndarray]:
    """``B**i`` and ``B**-i`` modulo ``2**64`` for ``i < length`` (at least), computed once for
    the longest text seen (doubling), then shared."""
    global _powers
    powers, inverses = _powers
    if len(powers) >= length:
        return powers, inverses
    with _powers_lock:
        size = max(length, 2 * len(_powers[0]))
        with np.errstate(over="ignore"):
            powers = np.full(size, _ANCHOR_BASE, dtype=np.uint64)
            powers[0] = 1
            inverses = np.full(size, _ANCHOR_BASE_INVERSE, dtype=np.uint64)
            inverses[0] = 1
            _powers = (np.cumprod(powers, dtype=np.uint64), np.cumprod(inverses, dtype=np.uint64))
        return _powers


def fingerprint_of(parts: Iterable[str | bytes]) -> str:
    """Combine the parts that identify a model setup into one short hex fingerprint."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(struct.pack("<q", len(data)))
        digest.update(data)
    return digest.hexdigest()[:32]
