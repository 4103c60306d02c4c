"""Serialization, the disk tier and the tier stack: round trips, corruption, budgets, restarts,
two processes sharing one directory."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from kvboost_rag.cache.codec import (
    CorruptEntryError,
    KVBlock,
    decode_block,
    encode_block,
)
from kvboost_rag.cache.storage import (
    CorruptPayloadError,
    DiskTier,
    MemoryTier,
    StoredEntry,
    TieredStore,
    build_store,
    deserialize_entry,
    serialize_entry,
)
from kvboost_rag.cache.storage import disk as disk_module
from kvboost_rag.cache.storage.disk import SUFFIX, TEMP_PREFIX
from kvboost_rag.cache.storage.serialization import HEADER_SIZE
from kvboost_rag.config import KVBoostSettings

LAYOUT = (2, 2, 8)  # layers, kv_heads, head_dim


def _entry(fill: float, tokens: int = 4, meta: str = "x") -> StoredEntry:
    return StoredEntry(
        tensors={"keys": torch.full((2, 2, tokens, 8), fill), "ids": torch.arange(tokens)},
        metadata={"tag": meta},
    )


def _block_entry(fingerprint: str = "fp-a", tokens: int = 6, bits: int | None = None) -> StoredEntry:
    gen = torch.Generator().manual_seed(tokens)
    shape = (*LAYOUT[:2], tokens, LAYOUT[2])
    block = KVBlock(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), torch.arange(tokens), 3)
    return encode_block(block, fingerprint=fingerprint, bits=bits, group_size=8)


def _same(a: StoredEntry, b: StoredEntry) -> bool:
    return a.metadata == b.metadata and a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )


def _file(tier: DiskTier, key: str) -> Path:
    return tier.directory / f"{key}{SUFFIX}"


# -- serialization ---------------------------------------------------------------------------


def test_serialization_round_trip_keeps_dtypes_shapes_and_metadata():
    base = torch.randn(4, 6)
    entry = StoredEntry(
        tensors={
            "f32": base,
            "bf16": base.to(torch.bfloat16),
            "f16": base.to(torch.float16),
            "i64": torch.arange(5),
            "u8": torch.randint(0, 255, (9,), dtype=torch.uint8),
            "empty": torch.zeros(0, 3),
            "view": base[:, 1:3],  # non-contiguous view of another tensor's storage
            "alias": base[1],  # contiguous slice sharing storage
        },
        metadata={"fingerprint": "abc", "shape": "1,2,3,4", "note": "ünïcode"},
    )
    data = serialize_entry(entry, key="k1")
    out = deserialize_entry(data, expected_key="k1")
    assert _same(out, entry)
    assert deserialize_entry(data).metadata == entry.metadata  # key field is not exposed


def test_serialization_reserves_its_key_field():
    with pytest.raises(ValueError, match="reserved"):
        serialize_entry(StoredEntry({}, {"__kvboost_key__": "x"}))


@pytest.mark.parametrize("where", ["magic", "version", "length", "digest", "safetensors_header", "tensor_data", "last"])
def test_any_flipped_byte_is_detected(where):
    data = bytearray(serialize_entry(_block_entry(), key="k"))
    positions = {
        "magic": 0,
        "version": 4,
        "length": 8,
        "digest": 20,
        "safetensors_header": HEADER_SIZE + 20,
        "tensor_data": len(data) - 100,
        "last": len(data) - 1,
    }
    data[positions[where]] ^= 0x10
    with pytest.raises(CorruptPayloadError):
        deserialize_entry(bytes(data), expected_key="k")


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE, HEADER_SIZE + 5, -1])
def test_truncated_or_padded_bytes_are_detected(cut):
    data = serialize_entry(_block_entry())
    with pytest.raises(CorruptPayloadError):
        deserialize_entry(data[:cut])
    with pytest.raises(CorruptPayloadError, match="truncated or padded"):
        deserialize_entry(data + b"\0")


def test_wrong_checksum_and_wrong_key_are_detected():
    data = bytearray(serialize_entry(_block_entry(), key="k"))
    data[16:HEADER_SIZE] = hashlib.sha256(b"something else").digest()
    with pytest.raises(CorruptPayloadError, match="checksum"):
        deserialize_entry(bytes(data))
    with pytest.raises(CorruptPayloadError, match="another key"):
        deserialize_entry(serialize_entry(_block_entry(), key="k"), expected_key="other")


def test_payload_with_valid_checksum_but_broken_safetensors_is_detected():
    payload = b"\xff" * 8 + b"not json"
    data = struct.pack("<4sIQ32s", b"KVBE", 1, len(payload), hashlib.sha256(payload).digest()) + payload
    with pytest.raises(CorruptPayloadError, match="safetensors"):
        deserialize_entry(data)


# -- disk tier -------------------------------------------------------------------------------


def test_disk_round_trip_and_restart_finds_everything(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**7)
    entries = {f"{i:04x}": _block_entry(tokens=4 + i, bits=(None, 8, 4)[i % 3]) for i in range(6)}
    for key, entry in entries.items():
        assert tier.put(key, entry) == []
    used = tier.used_bytes
    assert used == sum(_file(tier, k).stat().st_size for k in entries)
    tier.close()

    restarted = DiskTier(tmp_path, max_bytes=10**7)
    assert sorted(restarted.keys()) == sorted(entries)
    assert restarted.used_bytes == used and len(restarted) == 6
    for key, entry in entries.items():
        assert key in restarted
        loaded = restarted.get(key)
        assert loaded is not None and _same(loaded, entry)
        block = decode_block(loaded, fingerprint="fp-a", expected_layout=LAYOUT)
        assert block.num_tokens == int(key, 16) + 4
    assert "ffff" not in restarted and restarted.get("ffff") is None
    assert not list(tmp_path.glob(f"{TEMP_PREFIX}*"))


def test_disk_rejects_keys_that_are_not_file_names(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    for bad in ["../escape", "a/b", "", ".hidden"]:
        with pytest.raises(ValueError, match="cache key"):
            tier.put(bad, _entry(1.0))
        assert bad not in tier


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])


def _corrupt_checksum(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[16:HEADER_SIZE] = bytes(32)
    path.write_bytes(bytes(data))


def _corrupt_empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_corrupt_flip, _corrupt_truncate, _corrupt_checksum, _corrupt_empty])
def test_corrupt_disk_file_is_a_miss_and_is_deleted(tmp_path, caplog, damage):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    tier.put("aa", _block_entry())
    tier.put("bb", _block_entry(tokens=9))
    damage(_file(tier, "aa"))
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.disk"):
        assert tier.get("aa") is None
    assert "corrupt entry aa" in caplog.text
    assert not _file(tier, "aa").exists() and "aa" not in tier
    assert tier.used_bytes == _file(tier, "bb").stat().st_size
    assert tier.get("bb") is not None  # neighbours untouched
    tier.put("aa", _block_entry())  # and the key can be written again
    assert tier.get("aa") is not None


def test_file_copied_under_another_key_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    tier.put("aa", _block_entry())
    _file(tier, "bb").write_bytes(_file(tier, "aa").read_bytes())
    assert tier.get("bb") is None and not _file(tier, "bb").exists()
    assert tier.get("aa") is not None


@pytest.mark.parametrize(
    ("stored", "expected_layout", "message"),
    [
        (lambda: _block_entry(fingerprint="fp-other"), LAYOUT, "another model fingerprint"),
        (lambda: _block_entry(), (2, 2, 16), "does not fit layout"),
        (lambda: _block_entry(bits=4), (3, 2, 8), "does not fit layout"),
    ],
    ids=["other-fingerprint", "wrong-head-dim", "wrong-layers-quantized"],
)
def test_well_formed_bytes_with_wrong_contents_are_rejected_then_removed(tmp_path, stored, expected_layout, message):
    """Entries the tier cannot judge (another model, wrong shape) fail in decode_block; the
    caller deletes them and the next put overwrites them."""
    store = TieredStore([MemoryTier(10**6), DiskTier(tmp_path, max_bytes=10**6)])
    store.put("k1", stored())
    entry = store.get("k1")
    assert entry is not None
    with pytest.raises(CorruptEntryError, match=message):
        decode_block(entry, fingerprint="fp-a", expected_layout=expected_layout)
    store.delete("k1")
    assert not store.contains("k1") and not (tmp_path / f"k1{SUFFIX}").exists()
    assert store.get("k1") is None

    store.put("k1", stored())
    store.put("k1", _block_entry())  # overwrite with a good entry
    fresh = TieredStore([MemoryTier(10**6), DiskTier(tmp_path, max_bytes=10**6)])
    block = decode_block(fresh.get("k1"), fingerprint="fp-a", expected_layout=LAYOUT)
    assert block.num_tokens == 6


def test_shape_tampered_metadata_is_rejected(tmp_path):
    entry = _block_entry()
    tampered = StoredEntry(entry.tensors, {**entry.metadata, "shape": "2,2,7,8"})
    tier = DiskTier(tmp_path, max_bytes=10**6)
    tier.put("k", tampered)
    with pytest.raises(CorruptEntryError, match="token_ids length"):
        decode_block(tier.get("k"), fingerprint="fp-a", expected_layout=LAYOUT)


def test_disk_budget_evicts_least_used_first_and_never_pinned(tmp_path):
    size = len(serialize_entry(_entry(0.0), key="a0"))
    tier = DiskTier(tmp_path, max_bytes=3 * size)
    assert tier.put("a0", _entry(0.0)) == [] and tier.pin("a0")
    assert tier.put("a1", _entry(1.0)) == []
    assert tier.put("a2", _entry(2.0)) == []
    for _ in range(3):
        assert tier.get("a1") is not None
    assert tier.put("a3", _entry(3.0)) == ["a2"]  # a2: used once, a1: used four times
    assert tier.put("a4", _entry(4.0)) == ["a3"]
    assert sorted(tier.keys()) == ["a0", "a1", "a4"]
    assert not _file(tier, "a2").exists() and not _file(tier, "a3").exists()
    assert tier.used_bytes == 3 * size
    # Rewriting a key reuses its own space instead of evicting.
    assert tier.put("a4", _entry(5.0)) == []
    # An entry larger than the whole budget is not stored.
    big = StoredEntry({"x": torch.zeros(4 * size)})
    assert tier.put("big", big) == [] and "big" not in tier


def test_disk_budget_full_of_pinned_entries_stores_nothing(tmp_path, caplog):
    size = len(serialize_entry(_entry(0.0), key="p0"))
    tier = DiskTier(tmp_path, max_bytes=2 * size)
    tier.put("p0", _entry(0.0))
    tier.put("p1", _entry(1.0))
    assert tier.pin("p0") and tier.pin("p1")
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.disk"):
        assert tier.put("p2", _entry(2.0)) == []
    assert "pinned" in caplog.text and "p2" not in tier and sorted(tier.keys()) == ["p0", "p1"]


def test_restart_orders_eviction_by_modification_time(tmp_path):
    size = len(serialize_entry(_entry(0.0), key="a0"))
    tier = DiskTier(tmp_path, max_bytes=3 * size)
    for i, key in enumerate(["a0", "a1", "a2"]):
        tier.put(key, _entry(float(i)))
    now = time.time()
    for key, age in {"a0": 10, "a1": 300, "a2": 100}.items():  # a1 is the least recently used
        os.utime(_file(tier, key), (now - age, now - age))
    restarted = DiskTier(tmp_path, max_bytes=3 * size)
    assert restarted.put("a3", _entry(3.0)) == ["a1"]
    assert restarted.put("a4", _entry(4.0)) == ["a2"]


def test_hits_refresh_modification_time(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10**6)
    tier.put("a0", _entry(0.0))
    old = time.time() - 1000
    os.utime(_file(tier, "a0"), (old, old))
    tier.get("a0")
    assert _file(tier, "a0").stat().st_mtime > old + 900


def test_stale_temp_files_are_removed_and_fresh_ones_ignored(tmp_path):
    stale = tmp_path / f"{TEMP_PREFIX}aa-crashed"
    fresh = tmp_path / f"{TEMP_PREFIX}bb-inflight"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    tier = DiskTier(tmp_path, max_bytes=10**6)
    assert not stale.exists() and fresh.exists()
    assert list(tier.keys()) == [] and tier.used_bytes == 0


def test_budget_accounts_for_files_written_by_another_process(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_module, "RESCAN_SECONDS", 0.0)
    size = len(serialize_entry(_entry(0.0), key="a0"))
    ours = DiskTier(tmp_path, max_bytes=3 * size)
    theirs = DiskTier(tmp_path, max_bytes=3 * size)
    ours.put("a0", _entry(0.0))
    theirs.put("b0", _entry(1.0))
    theirs.put("b1", _entry(2.0))
    assert ours.used_bytes == size  # not yet aware of the other writer
    evicted = ours.put("a1", _entry(3.0))  # over budget -> rescan -> evict one
    assert len(evicted) == 1 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3
    assert ours.used_bytes == 3 * size
    assert ours.get("b1" if evicted != ["b1"] else "b0") is not None


def _two_process_worker(directory: str, worker: int, rounds: int, barrier, results) -> None:
    """Writes its own keys and rewrites shared keys while reading everything else."""
    torch.set_num_threads(1)  # two workers on a small machine: no intra-op thread contention
    corrupt = 0

    class _Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            nonlocal corrupt
            if "corrupt" in record.getMessage():
                corrupt += 1

    logging.getLogger("kvboost_rag.cache.storage.disk").addHandler(_Count(level=logging.WARNING))
    tier = DiskTier(directory, max_bytes=10**9)
    stats = {"consistent": 0, "inconsistent": 0, "missing": 0}
    other = 1 - worker
    barrier.wait(timeout=60)
    stats["start"] = time.time()
    for r in range(rounds):
        value = float(worker * 1000 + r)
        tier.put(f"w{worker}-{r:03d}", _entry(value, tokens=16, meta=str(value)))
        tier.put(f"shared-{r % 4}", _entry(value, tokens=2048, meta=str(value)))  # both rewrite these
        for key in (f"shared-{(r + 1) % 4}", f"shared-{(r + 2) % 4}", f"w{other}-{max(r - 1, 0):03d}"):
            entry = tier.get(key)
            if entry is None:
                stats["missing"] += 1
            elif float(entry.tensors["keys"].min()) == float(entry.tensors["keys"].max()) == float(entry.metadata["tag"]):
                stats["consistent"] += 1
            else:
                stats["inconsistent"] += 1
    stats["end"] = time.time()
    stats["corrupt"] = corrupt
    results.put(stats)


def test_two_processes_sharing_a_directory_lose_nothing(tmp_path):
    rounds = 80
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [
        ctx.Process(target=_two_process_worker, args=(str(tmp_path), w, rounds, barrier, results)) for w in (0, 1)
    ]
    for proc in workers:
        proc.start()
    stats = [results.get(timeout=120) for _ in workers]
    for proc in workers:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    for s in stats:
        assert s["corrupt"] == 0 and s["inconsistent"] == 0
        assert s["consistent"] > rounds  # most reads found the other process's or shared entries
    assert max(s["start"] for s in stats) < min(s["end"] for s in stats), "the workers did not overlap"
    tier = DiskTier(tmp_path, max_bytes=10**9)
    expected = {f"w{w}-{r:03d}" for w in (0, 1) for r in range(rounds)} | {f"shared-{i}" for i in range(4)}
    assert set(tier.keys()) == expected
    for key in expected:
        entry = tier.get(key)
        assert entry is not None and float(entry.metadata["tag"]) == float(entry.tensors["keys"][0, 0, 0, 0])
    assert not list(tmp_path.glob(f"{TEMP_PREFIX}*"))


def test_disk_tier_is_thread_safe(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    size = len(serialize_entry(_entry(0.0), key="t000"))
    tier = DiskTier(tmp_path, max_bytes=20 * size)

    def work(i: int) -> bool:
        key = f"t{i:03d}"
        tier.put(key, _entry(float(i)))
        got = tier.get(key)
        return got is None or float(got.tensors["keys"][0, 0, 0, 0]) == float(i)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(60)))
    files = list(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) <= 20 and tier.used_bytes == sum(f.stat().st_size for f in files)


# -- tier stack ------------------------------------------------------------------------------


def test_tiered_store_writes_through_and_promotes_hits(tmp_path):
    memory, disk = MemoryTier(10**6), DiskTier(tmp_path, max_bytes=10**6)
    store = TieredStore([memory, disk])
    store.put("k1", _entry(1.0))
    assert "k1" in memory and "k1" in disk

    # A fresh process: empty memory, same directory.
    memory2 = MemoryTier(10**6)
    store2 = TieredStore([memory2, DiskTier(tmp_path, max_bytes=10**6)])
    assert "k1" not in memory2
    assert _same(store2.get("k1"), _entry(1.0))
    assert "k1" in memory2  # promoted
    store2.get("k1")
    stats = store2.stats()
    assert stats["disk"]["hits"] == 1 and stats["memory"]["hits"] == 1
    assert store2.get("nope") is None and store2.misses == 1


def test_memory_evictions_fall_back_to_disk(tmp_path):
    one = _entry(0.0).nbytes
    store = TieredStore([MemoryTier(2 * one), DiskTier(tmp_path, max_bytes=10**6)])
    for i in range(5):
        store.put(f"e{i}", _entry(float(i)))
    assert store.stats()["memory"]["evictions"] == 3
    for i in range(5):
        assert float(store.get(f"e{i}").tensors["keys"][0, 0, 0, 0]) == float(i)
    stats = store.stats()
    assert stats["memory"]["hits"] + stats["disk"]["hits"] == 5 and stats["disk"]["hits"] >= 3


def test_build_store_stacks_the_configured_tiers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", str(tmp_path / "auto"))
    default = build_store(KVBoostSettings())
    assert [t.name for t in default.tiers] == ["memory", "disk"]
    assert default.tiers[1].spill_only and default.tiers[1].directory == tmp_path / "auto"
    monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", "off")
    assert [t.name for t in build_store(KVBoostSettings()).tiers] == ["memory"]
    assert [t.name for t in build_store(KVBoostSettings(disk_cache_dir=None)).tiers] == ["memory"]
    store = build_store(KVBoostSettings(disk_cache_dir=tmp_path / "kv", max_disk_bytes=12345))
    assert [t.name for t in store.tiers] == ["memory", "disk"] and not store.tiers[1].spill_only
    assert store.tiers[1].max_bytes == 12345 and (tmp_path / "kv").is_dir()
    store = build_store(
        KVBoostSettings(disk_cache_dir=tmp_path / "kv", redis_url="redis://127.0.0.1:1/0", redis_ttl_seconds=60)
    )
    assert [t.name for t in store.tiers] == ["memory", "disk", "redis"]
    assert store.tiers[2].ttl_seconds == 60
    store.put("k", _entry(2.0))  # Redis is down: the write still lands in memory and on disk
    assert _same(store.get("k"), _entry(2.0))
    store.close()


# -- through the engine ----------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one intra-op thread (and much faster on a busy machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _prompt(docs: list[str]) -> str:
    return "You are a careful assistant.\n\n" + "\n\n".join(docs) + "\n\nQuestion: What does it say?\nAnswer:"


@pytest.mark.parametrize(("bits", "memory_bytes"), [(None, 200_000), (8, 50_000)])
def test_engine_restart_reuses_the_disk_tier(make_engine, docs, tmp_path, one_thread, bits, memory_bytes):
    first = make_engine(disk_cache_dir=tmp_path, kv_cache_bits=bits, max_cache_bytes=memory_bytes)
    assert all(r.new_tokens > 0 for r in first.warm_documents(docs[:4]))
    prompt = _prompt(docs[:4][::-1])
    first.generate(prompt, max_new_tokens=6)
    expected = first.generate(prompt, max_new_tokens=6)
    assert first.cache_stats().tiers["memory"]["evictions"] > 0

    restarted = make_engine(disk_cache_dir=tmp_path, kv_cache_bits=bits, max_cache_bytes=memory_bytes)
    assert all(r.new_tokens == 0 for r in restarted.warm_documents(docs[:4]))  # nothing recomputed
    again = restarted.generate(prompt, max_new_tokens=6)
    assert again.token_ids == expected.token_ids
    assert again.content_hit_tokens == expected.content_hit_tokens > 0
    assert restarted.cache_stats().tiers["disk"]["hits"] > 0


def test_engine_answers_from_full_prefill_when_every_stored_file_is_corrupt(make_engine, docs, tmp_path, one_thread, caplog):
    # One lead-in (no context documents), so that warming it below reads every stored prefix.
    warm = make_engine(disk_cache_dir=tmp_path, warm_context_documents=0)
    warm.warm_documents(docs[:3])
    prompt = _prompt(docs[:3])
    for path in tmp_path.glob(f"*{SUFFIX}"):
        _corrupt_flip(path)

    fresh = make_engine(disk_cache_dir=tmp_path, warm_context_documents=0)
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.disk"):
        fresh.warm_documents(docs[:3])
        result = fresh.generate(prompt, max_new_tokens=6)
    assert "corrupt entry" in caplog.text
    assert result.content_hit_tokens == 0 and result.prefix_hit_tokens == 0
    assert result.token_ids == fresh.generate(prompt, max_new_tokens=6, reuse=False).token_ids
    # Corrupt files were deleted and the documents stored again from the prompt.
    assert all(fresh.is_document_warm(d) for d in docs[:3])
    # warm_documents found every chunk stored (files exist) and so read nothing, not even the
    # lead-in the documents were warmed behind: the first warm that starts with it reads it.
    fresh.warm(fresh.document_context)
    disk = DiskTier(tmp_path, max_bytes=10**9)
    with caplog.at_level(logging.WARNING, logger="kvboost_rag.cache.storage.disk"):
        caplog.clear()
        assert all(disk.get(key) is not None for key in disk.keys())
    assert "corrupt" not in caplog.text
