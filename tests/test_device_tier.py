"""The device-resident hot tier: budget, promotion into it, the stack build_store makes, and
engines on it: on CUDA the real stack (a device tier in GPU memory over pinned host memory),
on the CPU the same layout with the device tier in host memory."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag.cache.codec import KVBlock, decode_block, encode_block
from kvboost_rag.cache.storage import (
    DeviceTier,
    MemoryTier,
    PinnedMemoryTier,
    StoredEntry,
    TieredStore,
    build_store,
)
from kvboost_rag.config import KVBoostSettings

MiB = 1024**2

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


def cuda_layout_on(device: str, monkeypatch: pytest.MonkeyPatch, device_bytes: int, memory_bytes: int) -> dict[str, int]:
    """Settings for an engine whose store has a CUDA engine's layout: on CUDA what
    ``build_store`` makes of them; on the CPU the stack ``build_store`` makes there (memory,
    the automatic disk tier) under a device tier in host memory."""
    if device == "cpu":
        from kvboost_rag import engine as engine_module

        def cuda_layout(settings, device=None, device_tier_bytes=None):
            return TieredStore([DeviceTier(settings.device_cache_bytes, "cpu"), *build_store(settings, device).tiers])

        monkeypatch.setattr(engine_module, "build_store", cuda_layout)
    return {"device_cache_bytes": device_bytes, "max_cache_bytes": memory_bytes}


def device_and_memory_tiers(engine, device: str) -> tuple[DeviceTier, MemoryTier]:
    """The engine's two top tiers, checked to be a device tier on ``device`` over a memory
    tier (pinned on CUDA)."""
    device_tier, memory = engine._cache._store.tiers[:2]
    assert isinstance(device_tier, DeviceTier) and device_tier.device.type == device
    assert isinstance(memory, PinnedMemoryTier if device == "cuda" else MemoryTier) and not isinstance(memory, DeviceTier)
    return device_tier, memory


def test_cuda_tier_layout_charges_indexes_to_host_memory_only(make_engine, docs, monkeypatch, device):
    """The tier stack a CUDA engine builds (device tier above the memory tier): the indexes
    are charged to the host memory budget, never the device budget, and the stats report the
    memory tier as memory."""
    engine = make_engine("llama", **cuda_layout_on(device, monkeypatch, 5 * MiB, 64 * MiB))
    engine.warm_documents(docs)
    device_tier, memory = device_and_memory_tiers(engine, device)
    assert device_tier.reserved_bytes == 0
    assert memory.reserved_bytes == engine._cache.index_bytes > 0
    stats = engine.cache_stats()
    assert stats.memory_bytes == memory.used_bytes and stats.index_bytes == memory.reserved_bytes
    assert stats.documents == len(docs) and stats.documents_by_tier["memory"] == len(docs)


def test_cuda_tier_layout_holds_nothing_but_kv_through_warms_generates_batches_and_evictions(
    make_engine, docs, monkeypatch, device
):
    """The tier stack a CUDA engine builds, with a device tier small enough to evict: every
    entry ever placed on the device tier is a K/V block (keys and values on the device,
    token ids on the host), never a document record or other host metadata, and the engine
    warms, serves documents from it, evicts and decodes."""
    from kvboost_rag.cache.storage import HOST_TENSORS

    placed: list[tuple[str, StoredEntry]] = []
    original = DeviceTier.put_many

    def spying_put_many(self, items):
        evicted = original(self, items)
        placed.extend((key, self.resident(key)) for key, _ in items if self.resident(key) is not None)
        return evicted

    monkeypatch.setattr(DeviceTier, "put_many", spying_put_many)
    block_bytes = _entry(tokens=32).nbytes  # about one 32-token chunk of this layout's size
    engine = make_engine("llama", **cuda_layout_on(device, monkeypatch, 40 * block_bytes, 256 * MiB))
    device_tier, _ = device_and_memory_tiers(engine, device)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs)
    single = engine.generate(rag_prompt([docs[2], docs[0], docs[4]]), max_new_tokens=3)
    batch = engine.generate_batch([rag_prompt([docs[1], docs[3]]), rag_prompt([docs[5], docs[2]])], max_new_tokens=3)
    assert single.content_hit_tokens > 0 and all(r.content_hit_tokens > 0 for r in batch)
    assert single.generated_tokens == 3 and all(r.generated_tokens == 3 for r in batch)
    stats = engine.cache_stats().tiers["device"]
    assert stats["evictions"] > 0 and stats["hits"] > 0  # groups left the device tier; hits were served there
    assert placed and all(not entry.host_only for _, entry in placed)
    assert all(not key.startswith("doc-") for key, _ in placed)
    for _, entry in placed:
        assert {"keys", "values"} <= set(entry.tensors) and set(entry.tensors) - {"keys", "values"} <= HOST_TENSORS
        assert all(t.device.type == (device if name not in HOST_TENSORS else "cpu") for name, t in entry.tensors.items())
    assert all(not entry.host_only for key in device_tier.keys() for entry in [device_tier.resident(key)])


def test_a_group_moves_to_the_device_tier_in_one_copy_per_dtype():
    """Promoting one chunk of a document brings its whole group up in one transfer (from
    pageable memory: packed, then moved; from pinned memory on a GPU each tensor is an
    asynchronous transfer into its place): the device entries are views of one allocation;
    the record of the group stays below."""
    from kvboost_rag.dev.op_counts import OpCounter

    group = {"c1": "doc", "c2": "doc", "c3": "doc", "record": "doc"}
    device, memory = DeviceTier(10**7, "meta"), MemoryTier(10**7)
    store = TieredStore([device, memory])
    store.group_by(group.get)
    for i, key in enumerate(["c1", "c2", "c3"]):
        memory.put(key, _entry(tokens=4 + i, seed=i))
    memory.put("record", StoredEntry({"text": torch.zeros(5, dtype=torch.uint8)}, {"kind": "document"}))
    with OpCounter() as counted:
        store.get("c2")
    assert set(device.keys()) == {"c1", "c2", "c3"}  # not the record
    assert counted.counts.by_name["copy_"] == 1  # one transfer for every K/V tensor of the group
    moved = [device.resident(k).tensors[name] for k in ("c1", "c2", "c3") for name in ("keys", "values")]
    assert all(t._base is not None for t in moved) and len({id(t._base) for t in moved}) == 1  # one allocation
    assert all(device.resident(k).tensors["token_ids"].device.type == "cpu" for k in ("c1", "c2", "c3"))
    assert store.get("c1") is device.resident("c1") and store.stats()["device"]["hits"] == 1


def test_warmed_documents_are_found_by_the_next_prompt_on_the_engines_device(make_engine, docs, device):
    """Warm documents, then a prompt holding them in another order, with default settings:
    on CUDA the documents' K/V are served from the device tier while their records stay on
    the host (a record copied to the GPU broke the first document hit), and the engine
    decodes; the same prompt again is served the same way."""
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    prompt = rag_prompt([docs[3], docs[1], docs[0]])
    for _ in range(2):
        result = engine.generate(prompt, max_new_tokens=4)
        assert result.documents_found == 3 and result.content_hit_tokens > 0
        assert result.generated_tokens == 4
    tiers = engine.cache_stats().tiers
    if device == "cuda":
        device_tier = engine._cache._store.tiers[0]
        assert isinstance(device_tier, DeviceTier) and tiers["device"]["hits"] > 0
        assert all(device_tier.resident(key).tensors["keys"].is_cuda for key in device_tier.keys())
    else:
        assert "device" not in tiers and tiers["memory"]["hits"] > 0
