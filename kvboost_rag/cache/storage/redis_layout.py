"""How one entry is laid out in Redis keys: hash-tagged names and parts of large values.

An entry ``key`` lives under ``<prefix>{<key>}``. The braces are a Redis Cluster hash tag:
only the text inside them picks the slot, so every key of one entry lands on one shard, and
a lookup reads them there in one round trip. Entries spread over shards by their own keys.

A value up to ``part_bytes`` is stored whole under that name. A larger one (the K/V of a long
chunk of a large model runs to tens of MB) is cut into parts, stored under
``<name>:1 .. <name>:n``, and the name holds a small header (``KVPT``, the part count, the
total length); all are written in one transaction, so a reader sees all or nothing. Parts keep
each command small: one large value blocks a Redis server while it is copied and, in a
cluster, while its slot migrates. Whatever the parts hold is checked as a whole by the
serialization's checksum (and MAC), so a missing or evicted part is a miss, never wrong K/V.
"""

from __future__ import annotations

import struct

#: Default largest value stored under one Redis key.
DEFAULT_PART_BYTES = 4 << 20
PARTS_MAGIC = b"KVPT"
_PARTS_HEADER = struct.Struct("<4sIQ")
PARTS_HEADER_BYTES = _PARTS_HEADER.size


def check_prefix(prefix: str) -> None:
    """Reject a key prefix that would break the layout.

    Raises:
        ValueError: Empty (``clear`` deletes every key under it), or holding ``{`` or ``}``
            (the prefix would become the hash tag and put every entry on one shard).
    """
    if not prefix:
        raise ValueError("key_prefix must not be empty (clear() deletes every key under it)")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"key_prefix must not contain braces (they are the cluster hash tag), got {prefix!r}")


def entry_name(prefix: str, key: str) -> str:
    """Redis name of entry ``key``: ``<prefix>{<key>}``."""
    return f"{prefix}{{{key}}}"


def part_names(name: str, count: int) -> list[str]:
    """Names of the ``count`` parts of the entry stored under ``name`` (same hash tag)."""
    return [f"{name}:{i}" for i in range(1, count + 1)]


def key_of_name(prefix: str, name: str) -> str | None:
    """The entry key an entry name holds; ``None`` for a part or a foreign name."""
    if not (name.startswith(prefix + "{") and name.endswith("}")):
        return None
    return name[len(prefix) + 1 : -1]


def split_value(data: bytes, part_bytes: int) -> tuple[bytes, list[bytes]]:
    """What to store under the entry name, and the parts (none when ``data`` fits in one)."""
    if len(data) <= part_bytes:
        return data, []
    parts = [data[i : i + part_bytes] for i in range(0, len(data), part_bytes)]
    return _PARTS_HEADER.pack(PARTS_MAGIC, len(parts), len(data)), parts


def parts_header(head: bytes) -> tuple[int, int] | None:
    """``(part count, total bytes)`` when ``head`` (the value under an entry name, or its
    first bytes) is a parts header; ``None`` for a whole value."""
    if len(head) < PARTS_HEADER_BYTES or not head.startswith(PARTS_MAGIC):
        return None
    _, count, total = _PARTS_HEADER.unpack_from(head)
    return count, total
