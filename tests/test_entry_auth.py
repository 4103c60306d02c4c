"""Entries authenticated with a secret key (HMAC-SHA256): with a key set, only entries
authenticated under that key are read; the others are misses and are deleted."""

from __future__ import annotations

import hashlib
import logging
import struct

import pytest
import torch
from pydantic import ValidationError

from kvboost_rag.cache.codec import KVBlock, decode_block, encode_block
from kvboost_rag.cache.storage import (
    DiskTier,
    StoredEntry,
    build_store,
    deserialize_entry,
    serialize_entry,
    warn_if_shared_without_key,
)
from kvboost_rag.cache.storage.disk import SUFFIX
from kvboost_rag.cache.storage.serialization import CorruptPayloadError
from kvboost_rag.config import KVBoostSettings

LAYOUT = (2, 2, 8)


def _entry(tokens: int = 6) -> StoredEntry:
    gen = torch.Generator().manual_seed(tokens)
    shape = (*LAYOUT[:2], tokens, LAYOUT[2])
    block = KVBlock(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(tokens), 3)
    return encode_block(block, fingerprint="fp", group_size=8)


def _decode(entry: StoredEntry) -> KVBlock:
    return decode_block(entry, fingerprint="fp", expected_layout=LAYOUT)


KEY_A = b"0123456789abcdef-a"
KEY_B = b"0123456789abcdef-b"


def test_authenticated_round_trip_and_rejections():
    entry = _entry()
    data = serialize_entry(entry, key="k", secret_key=KEY_A)
    assert _decode(deserialize_entry(data, expected_key="k", secret_key=KEY_A)).num_tokens == 6
    with pytest.raises(CorruptPayloadError, match="another secret key or tampered"):
        deserialize_entry(data, expected_key="k", secret_key=KEY_B)
    with pytest.raises(CorruptPayloadError, match="not authenticated"):
        deserialize_entry(serialize_entry(entry, key="k"), expected_key="k", secret_key=KEY_A)
    with pytest.raises(CorruptPayloadError, match="secret key"):
        deserialize_entry(data, expected_key="k")  # a reader without the key cannot verify it


def test_recomputed_checksum_does_not_forge_an_authenticated_entry():
    data = bytearray(serialize_entry(_entry(), key="k", secret_key=KEY_A))
    header = struct.Struct("<4sIQ32s")
    magic, version, length, _ = header.unpack_from(data)
    payload = bytes(data[header.size :])
    for forged_version in (version, 1):
        forged = header.pack(magic, forged_version, length, hashlib.sha256(payload).digest()) + payload
        with pytest.raises(CorruptPayloadError):
            deserialize_entry(forged, expected_key="k", secret_key=KEY_A)


@pytest.mark.parametrize("writer_key", [None, KEY_B])
def test_disk_tier_with_a_key_drops_entries_not_authenticated_with_it(tmp_path, writer_key):
    DiskTier(tmp_path, max_bytes=10**6, secret_key=writer_key).put("aa", _entry())
    reader = DiskTier(tmp_path, max_bytes=10**6, secret_key=KEY_A)
    assert reader.get("aa") is None
    assert not (tmp_path / f"aa{SUFFIX}").exists()
    reader.put("aa", _entry())
    assert reader.get("aa") is not None
    assert DiskTier(tmp_path, max_bytes=10**6, secret_key=KEY_A).get("aa") is not None


def test_secret_key_setting_is_validated_and_hidden():
    with pytest.raises(ValidationError, match="cache_secret_key"):
        KVBoostSettings(cache_secret_key="short")
    settings = KVBoostSettings(cache_secret_key="a-long-enough-secret")
    assert "a-long-enough-secret" not in repr(settings) and "a-long-enough-secret" not in str(settings.model_dump())


def test_build_store_applies_the_secret_key_to_the_disk_tier(tmp_path):
    keyed = build_store(KVBoostSettings(disk_cache_dir=tmp_path, cache_secret_key="a-long-enough-secret"))
    keyed.put("aa", _entry())
    data = (tmp_path / f"aa{SUFFIX}").read_bytes()
    assert deserialize_entry(data, expected_key="aa", secret_key=b"a-long-enough-secret").metadata["fingerprint"] == "fp"
    other = build_store(KVBoostSettings(disk_cache_dir=tmp_path, cache_secret_key="another-long-secret"))
    assert other.get("aa") is None and not (tmp_path / f"aa{SUFFIX}").exists()


def _unsigned_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvboost_rag.cache.storage" and "without cache_secret_key" in r.getMessage()]


def test_a_shared_tier_without_a_key_is_warned_about_once_per_process(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage"):
        build_store(KVBoostSettings(disk_cache_dir=tmp_path / "a"))
        build_store(KVBoostSettings(disk_cache_dir=tmp_path / "b"))  # a second store: no second warning
    [message] = _unsigned_warnings(caplog)
    assert str(tmp_path / "a") in message and "plant K/V" in message


def test_no_warning_with_a_key_or_without_a_shared_tier(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage"):
        build_store(KVBoostSettings(disk_cache_dir=tmp_path, cache_secret_key="a-long-enough-secret"))
        build_store(KVBoostSettings(disk_cache_dir=None))
        assert not warn_if_shared_without_key(KVBoostSettings(redis_url="redis://127.0.0.1:1/0",
                                                              cache_secret_key="a-long-enough-secret"))
    assert _unsigned_warnings(caplog) == []
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage"):
        assert warn_if_shared_without_key(KVBoostSettings(redis_url="redis://127.0.0.1:1/0"))
        assert not warn_if_shared_without_key(KVBoostSettings(redis_url="redis://127.0.0.1:1/0"))  # once
    [message] = _unsigned_warnings(caplog)
    assert message.startswith("Redis shared without cache_secret_key")
