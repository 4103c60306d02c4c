"""The device-resident hot tier: budget, promotion into it, and the stack build_store makes."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvboost_rag.config import KVBoostSettings
from kvboost_rag.kv_codec import KVBlock, decode_block, encode_block
from kvboost_rag.storage import DeviceTier, MemoryTier, PinnedMemoryTier, StoredEntry, TieredStore, build_store

LAYOUT = (2, 2, 8)


def _entry(tokens: int = 4, bits: int | None = None, seed: int = 0) -> StoredEntry:
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYOUT[0], LAYOUT[1], tokens, LAYOUT[2])
    block = KVBlock(
        keys=torch.randn(shape, generator=generator),
        values=torch.randn(shape, generator=generator),
        token_ids=torch.arange(tokens),
        start_position=3,
    )
    return encode_block(block, fingerprint="fp", bits=bits, group_size=4 if bits else 32)


def test_entries_are_moved_to_the_tiers_device():
    # The meta device stands in for an accelerator: K/V move there; token ids stay on the
    # host, where they are compared with prompt tokens (no device read per chunk).
    tier = DeviceTier(10**6, "meta")
    tier.put("a", _entry())
    held = tier.get("a")
    assert held is not None and held.tensors["token_ids"].device.type == "cpu"
    assert {t.device.type for name, t in held.tensors.items() if name != "token_ids"} == {"meta"}
    assert tier.used_bytes == _entry().nbytes


def test_device_budget_evicts_least_used_entries():
    size = _entry().nbytes
    tier = DeviceTier(2 * size + 1, "cpu")
    for key in ("a", "b"):
        tier.put(key, _entry())
    tier.get("a")
    evicted = tier.put("c", _entry())
    assert evicted == ["b"]
    assert set(tier.keys()) == {"a", "c"} and tier.used_bytes == 2 * size


def test_hit_below_is_promoted_and_served_from_the_device_copy():
    device, memory = DeviceTier(10**6, "meta"), MemoryTier(10**6)
    store = TieredStore([device, memory])
    memory.put("k", _entry())
    served = store.get("k")
    assert served is device.resident("k")
    assert {t.device.type for name, t in served.tensors.items() if name != "token_ids"} == {"meta"}
    assert store.stats()["memory"]["hits"] == 1
    assert store.get("k") is served and store.stats()["device"]["hits"] == 1


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_entries_from_the_device_tier_decode_like_the_originals(bits):
    store = TieredStore([DeviceTier(10**6, "cpu"), MemoryTier(10**6)])
    original = _entry(tokens=6, bits=bits)
    store.tiers[1].put("k", original)
    served = store.get("k")
    assert served.tensors.keys() == original.tensors.keys()  # held quantized, dequantized on decode
    expected = decode_block(original, fingerprint="fp", expected_layout=LAYOUT)
    got = decode_block(served, fingerprint="fp", expected_layout=LAYOUT)
    assert torch.equal(expected.keys, got.keys) and torch.equal(expected.values, got.values)


def test_build_store_adds_device_and_pinned_tiers_on_cuda_only():
    settings = KVBoostSettings(device_cache_bytes=5 * 1024**2, disk_cache_dir=None)
    on_cpu = build_store(settings, torch.device("cpu"))
    assert [type(t) for t in on_cpu.tiers] == [MemoryTier]
    assert [type(t) for t in build_store(settings).tiers] == [MemoryTier]
    # Building the stack touches no GPU: only the types and budgets are checked here.
    on_gpu = build_store(settings, "cuda")
    assert [type(t) for t in on_gpu.tiers] == [DeviceTier, PinnedMemoryTier]
    assert on_gpu.tiers[0].max_bytes == 5 * 1024**2 and on_gpu.tiers[0].device == torch.device("cuda")
    without = build_store(KVBoostSettings(device_cache_bytes=0, disk_cache_dir=None), "cuda:0")
    assert [type(t) for t in without.tiers] == [PinnedMemoryTier]


def test_negative_device_budget_is_rejected():
    with pytest.raises(ValidationError, match="device_cache_bytes"):
        KVBoostSettings(device_cache_bytes=-1)


def test_cuda_tier_layout_charges_indexes_to_host_memory_only(make_engine, docs, monkeypatch):
    """The tier stack a CUDA engine builds (device tier above the memory tier), built on CPU:
    the indexes are charged to the host memory budget, never the device budget, and the
    stats report the memory tier as memory."""
    from kvboost_rag import engine as engine_module

    def cuda_layout(settings, device=None):
        return TieredStore([DeviceTier(5 * 1024**2, "cpu"), MemoryTier(64 * 1024**2)])

    monkeypatch.setattr(engine_module, "build_store", cuda_layout)
    engine = make_engine("llama")
    engine.warm_documents(docs)
    device_tier, memory = engine._cache._store.tiers
    assert isinstance(device_tier, DeviceTier) and not isinstance(memory, DeviceTier)
    assert device_tier.reserved_bytes == 0
    assert memory.reserved_bytes == engine._cache.index_bytes > 0
    stats = engine.cache_stats()
    assert stats.memory_bytes == memory.used_bytes and stats.index_bytes == memory.reserved_bytes
    assert stats.documents == len(docs) and stats.documents_by_tier["memory"] == len(docs)
