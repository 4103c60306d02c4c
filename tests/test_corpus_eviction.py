"""A corpus larger than the cache: documents are kept or dropped whole, and the user is told.

Tiny budgets (the documents are worth 2-5x the memory tier) with memory only, memory + disk
(explicit and automatic; memory + Redis: ``test_storage_redis.py``); a property test of random
warms, generates and evictions checking that the registry, the prefix index and the tiers
agree.
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt

import kvboost_rag.generation.completion as completion_module
import kvboost_rag.warming.documents as warming_module
from kvboost_rag import KVBoost
from kvboost_rag.cache.storage import DiskTier, MemoryTier, StoredEntry, TieredStore
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.log_limits import RateLimitedLogger

DOCS = python_reference_documents(max_chars=240)[:24]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the engine's first warning of each kind."""
    for module in (completion_module, warming_module):
        monkeypatch.setattr(module, "_warnings", RateLimitedLogger(module.logger))


def _corpus_bytes(engine: KVBoost, docs: list[str]) -> int:
    return int(sum(engine.count_tokens(d) for d in docs) * engine._cache.bytes_per_token())


def _budgeted(make_engine, factor: float, **settings) -> KVBoost:
    """An engine whose memory tier holds 1/``factor`` of :data:`DOCS`' K/V."""
    probe = make_engine("llama", **settings)
    budget = int(_corpus_bytes(probe, DOCS) / factor)
    return make_engine("llama", max_cache_bytes=budget, **settings)


def _memory(engine: KVBoost) -> MemoryTier:
    return engine._cache._store.memory_tier


def check_agreement(engine: KVBoost, memory_only: bool) -> None:
    """The registry, the prefix index and the tiers agree: no orphan chunk, no record
    without its chunks (memory only), no index entry for what no tier holds; checked once
    the writes queued so far are done (a call returns before its writes reach the tiers)."""
    engine.flush()
    cache = engine._cache
    memory = _memory(engine)
    held = set(memory.keys())
    records = {}
    for key in held:
        parsed = cache.index.shelf.parse_key(key)
        if parsed is not None:
            records[parsed[1]] = key
    prefix_keys = set(cache.index.prefixes.keys())
    for key in held:
        if key in records.values():
            continue
        owners = cache.index._owners.get(key)
        if owners:
            # A document chunk: some owner's record is held beside it (memory only), or in
            # some tier (a lower tier keeps whole documents; memory holds what prompts load).
            if memory_only:
                assert any(digest in records for digest in owners), f"orphan chunk {key[:12]}"
            else:
                stored = [cache.index.shelf.key_of(cache.index._documents[d][0], d) for d in owners if d in cache.index._documents]
                assert any(cache._store.contains(k) for k in stored), f"orphan chunk {key[:12]}"
        else:
            assert key in prefix_keys, f"unindexed entry {key[:12]}"
    for key in prefix_keys:
        assert cache._store.contains(key), f"prefix index holds {key[:12]} that no tier holds"
    for anchor, digest in cache.index.known_documents().known():
        record_key = cache.index.shelf.key_of(anchor, digest)
        assert cache._store.contains(record_key), "registry knows a document whose record is gone"
        chunks = cache.index._documents[digest][1]
        assert all(cache._store.contains(chunk) for chunk in chunks), "a kept document lost a chunk"
        if memory_only:
            assert all(chunk in held for chunk in chunks), "record held without its chunks"
    for tier in cache._store.tiers:
        for key in tier.keys_with_prefix(cache.index.shelf.prefix):
            anchor, digest = cache.index.shelf.parse_key(key)
            assert digest in dict((d, a) for a, d in cache.index.known_documents().known()), "a stored record the registry forgot"
    assert memory.used_bytes <= memory.max_bytes


@pytest.mark.parametrize("factor", [2, 5])
def test_memory_only_keeps_or_drops_documents_whole(make_engine, caplog, factor):
    engine = _budgeted(make_engine, factor, disk_cache_dir=None)
    engine.warm(SYSTEM_PROMPT + "\n\n")
    with caplog.at_level(logging.INFO, logger="kvboost_rag"):
        results = engine.warm_documents(DOCS)
    check_agreement(engine, memory_only=True)
    stats = engine.cache_stats()
    kept = [r for r in results if r.kept_in]
    assert all(r.kept_in == ["memory"] for r in kept)
    assert 0 < len(kept) < len(DOCS)
    assert stats.documents == len(kept) and stats.documents_evicted == len(DOCS) - len(kept)
    assert stats.documents_by_tier == {"memory": len(kept)}
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "need about" in messages and "disk_cache_dir" in messages and "kv_cache_bits=8" in messages
    assert f"{len(kept)} of {len(DOCS)} documents kept" in messages
    # Every kept document is reused whole; an evicted one is named as evicted.
    survivors = [d for d, r in zip(DOCS[2:], results[2:]) if r.kept_in][:3]
    result = engine.generate(rag_prompt(survivors), max_new_tokens=1)
    assert result.documents_found == len(survivors) and result.content_hit_tokens > 0
    lost = [d for d, r in zip(DOCS[2:], results[2:]) if not r.kept_in][:3]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        engine.generate(rag_prompt(lost), max_new_tokens=1)
    assert any("warmed and then evicted" in r.getMessage() for r in caplog.records)
    check_agreement(engine, memory_only=True)


@pytest.mark.parametrize("disk", ["explicit", "auto"])
def test_memory_and_disk_keep_every_document(make_engine, tmp_path, disk):
    settings = {"disk_cache_dir": tmp_path / "kv"} if disk == "explicit" else {}
    engine = _budgeted(make_engine, 4, **settings)
    engine.warm(SYSTEM_PROMPT + "\n\n")
    results = engine.warm_documents(DOCS)
    assert all("disk" in r.kept_in for r in results) if disk == "explicit" else all(r.kept_in for r in results)
    stats = engine.cache_stats()
    assert stats.documents == len(DOCS) and stats.documents_evicted == 0
    assert stats.documents_by_tier["disk"] >= len(DOCS) - stats.documents_by_tier["memory"]
    check_agreement(engine, memory_only=False)
    # Documents demoted to disk come back whole (the first two are the warm's context
    # documents, served as an exact prefix when a prompt starts with them).
    demoted = [d for d, r in zip(DOCS[2:], results[2:]) if "memory" not in r.kept_in][:4]
    assert demoted
    result = engine.generate(rag_prompt(demoted), max_new_tokens=1)
    assert result.documents_found == len(demoted)
    assert result.content_hit_tokens == sum(engine.count_tokens(d) for d in demoted) - result.boundary_merged_tokens
    check_agreement(engine, memory_only=False)


def test_documents_prompts_keep_using_stay_while_the_corpus_streams_past(make_engine):
    """Memory only, the corpus 3x the budget: documents that prompts keep using stay whole
    while one-off prompts and the rest of the corpus pass through."""
    engine = _budgeted(make_engine, 3, disk_cache_dir=None)
    engine.warm(SYSTEM_PROMPT + "\n\n")
    hot = DOCS[3:6]  # not the warm's context documents (those sit in a pinned lead-in)
    results = engine.warm_documents(DOCS[:6])
    assert all(r.kept_in == ["memory"] for r in results[3:6])
    hot_tokens = sum(engine.count_tokens(d) for d in hot)
    for _ in range(2):
        assert engine.generate(rag_prompt(hot), max_new_tokens=1).documents_found == len(hot)
    for i in range(6, len(DOCS), 3):
        engine.warm_documents(DOCS[i : i + 3])
        engine.generate(f"One-off question {i}: what is topic {i * 7919} about?", max_new_tokens=1)
        result = engine.generate(rag_prompt(hot[i % 3 :] + hot[: i % 3]), max_new_tokens=1)
        assert result.documents_found == len(hot)
        assert result.content_hit_tokens + result.prefix_hit_tokens + result.boundary_merged_tokens >= hot_tokens
    stats = engine.cache_stats()
    assert stats.documents_evicted > 0 and stats.documents < len(DOCS)
    check_agreement(engine, memory_only=True)


def test_the_automatic_disk_tier_writes_only_what_memory_evicts(make_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", str(tmp_path / "auto"))
    engine = make_engine("llama")
    engine.warm_documents(DOCS[:3])
    disk = engine._cache._store.tiers[-1]
    assert isinstance(disk, DiskTier) and disk.spill_only and len(disk) == 0
    monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", "off")
    assert [t.name for t in make_engine("llama")._cache._store.tiers] == ["memory"]


def _pinned(engine: KVBoost) -> set[str]:
    memory = _memory(engine)
    return {key for key in memory.keys() if memory.policy.is_pinned(key)}


def test_two_models_share_the_automatic_disk_tier_without_mixing(tokenizer, tmp_path, monkeypatch):
    """Two models (other weights) spill to the same automatic folder: each keeps its own
    documents whole and finds none of the other's (keys are namespaced by fingerprint)."""
    monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", str(tmp_path / "shared"))
    engines = []
    for seed in (0, 1):
        probe = KVBoost.from_model(tiny_model("llama", seed=seed), tokenizer, show_progress=False, chunk_size=32)
        budget = int(_corpus_bytes(probe, DOCS) / 3)
        engines.append(
            KVBoost.from_model(
                tiny_model("llama", seed=seed), tokenizer, show_progress=False, chunk_size=32, max_cache_bytes=budget
            )
        )
    assert engines[0].fingerprint != engines[1].fingerprint
    for engine in engines:
        engine.warm(SYSTEM_PROMPT + "\n\n")
        assert all(r.kept_in for r in engine.warm_documents(DOCS))
    for engine in engines:
        stats = engine.cache_stats()
        assert stats.documents == len(DOCS) and stats.documents_evicted == 0
        check_agreement(engine, memory_only=False)
        # DOCS[9] starts unlike the context documents: a partial prefix hit over a first
        # document's opening tokens takes that document out of content reuse (prefill today).
        result = engine.generate(rag_prompt(DOCS[9:13]), max_new_tokens=1)
        assert result.documents_found == 4 and result.content_hit_tokens > 0
    # A fresh process of the second model lists its own spilled records, not the first's.
    fresh = KVBoost.from_model(tiny_model("llama", seed=1), tokenizer, show_progress=False, chunk_size=32)
    on_disk = fresh.cache_stats().documents_by_tier["disk"]
    assert 0 < on_disk == engines[1].cache_stats().documents_by_tier["disk"]


@pytest.mark.parametrize("tiers", ["memory", "memory+overflow disk", "memory+disk"])
@pytest.mark.parametrize("seed", range(4))
def test_random_warms_generates_and_evictions_keep_everything_in_agreement(make_engine, tmp_path, monkeypatch, tiers, seed):
    """Random operations over a tiny budget; after each one the registry, the prefix index and
    the tiers agree, and the pinned system prompt is still in memory. With a disk tier, its
    budget is tiny too, so it evicts entries of its own (one chunk at a time) and the rest of
    each such document must go with it."""
    rng = random.Random(seed)
    factor = rng.choice([2, 3, 5])
    settings: dict = {"disk_cache_dir": None}
    if tiers != "memory":
        probe = make_engine("llama", disk_cache_dir=None)
        disk_budget = int(_corpus_bytes(probe, DOCS) * rng.choice([0.3, 0.6]))
        settings = {"max_disk_bytes": disk_budget}
        if tiers == "memory+disk":
            settings["disk_cache_dir"] = tmp_path / "kv"
        else:
            monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", str(tmp_path / "auto"))
    engine = _budgeted(make_engine, factor, **settings)
    assert [t.name for t in engine._cache._store.tiers] == (["memory"] if tiers == "memory" else ["memory", "disk"])
    engine.warm(SYSTEM_PROMPT + "\n\n")
    system = _pinned(engine)
    assert system
    ops = Counter()
    for step in range(20):
        op = rng.choice(["warm", "warm", "generate", "generate", "novel", "squeeze"])
        ops[op] += 1
        if op == "warm":
            engine.warm_documents(rng.sample(DOCS, rng.randint(1, 8)))
        elif op == "generate":
            engine.generate(rag_prompt(rng.sample(DOCS, rng.randint(1, 4))), max_new_tokens=1)
        elif op == "novel":
            engine.generate(f"Chat {step}: tell me about topic {rng.randint(0, 10**6)} in detail.", max_new_tokens=1)
        else:  # the indexes grow (or another owner reserves room): entries are evicted
            engine._cache._store.reserve("test", rng.randint(0, _memory(engine).max_bytes // 2))
        check_agreement(engine, memory_only=tiers == "memory")
        assert system <= set(_memory(engine).keys()), "the pinned system prompt was evicted"
    stats = engine.cache_stats()
    assert stats.documents + stats.documents_evicted >= 1
    assert stats.counters.get("stored_entries", 0) > 0
    assert len(ops) >= 3  # the sequence really mixes operations


# -- the memory tier's eviction order --------------------------------------------------------


def _entry(nbytes: int = 400) -> StoredEntry:
    return StoredEntry({"keys": torch.zeros(nbytes // 4, dtype=torch.float32)})


def test_one_off_prefix_chunks_go_before_documents_and_reused_documents_stay():
    groups = {"d1-a": "d1", "d1-b": "d1", "d2-a": "d2", "d2-b": "d2"}
    tier = MemoryTier(max_bytes=6 * 400)
    tier.group_of = groups.get
    for key in ("d1-a", "d1-b", "d2-a", "d2-b"):
        tier.put(key, _entry())
    tier.put("system", _entry())
    assert tier.pin("system")
    tier.put("one-off", _entry())
    assert tier.get("d2-a") is not None  # a prompt reuses document d2
    evicted = tier.put("another one-off", _entry())
    assert evicted == ["one-off"]  # the unused prefix chunk, not a document
    evicted = tier.put("third", _entry())
    assert evicted == ["another one-off"]
    tier.get("third")  # reused: now ranked with the documents
    evicted = tier.put("big", _entry(800))
    assert sorted(evicted) == ["d1-a", "d1-b"]  # the document nobody reused, whole
    assert "system" in tier and "d2-a" in tier and "d2-b" in tier


def test_an_overflow_tier_receives_what_memory_evicts_but_one_off_entries(tmp_path):
    memory = MemoryTier(max_bytes=2 * 400)
    disk = DiskTier(tmp_path, max_bytes=10**6, spill_only=True)
    store = TieredStore([memory, disk])
    gone: list[str] = []
    store.on_gone(gone.append)
    store.put("a", _entry())
    store.put("b", _entry())
    assert len(disk) == 0  # nothing written through
    assert store.get("a") is not None and store.get("b") is not None  # both reused
    store.put("c", _entry())
    assert "a" in disk and "a" not in memory and not gone  # a demotion, not a loss
    store.put("d", _entry())  # evicts "c", a one-off: dropped, not written to disk
    assert "c" not in disk and "c" not in memory and gone == ["c"]
    assert store.get("a") is not None and "a" in memory


def test_rewarming_documents_partly_spilled_to_disk_counts_them_kept(make_engine, tmp_path, caplog):
    """A process warms a corpus larger than memory (the automatic disk tier takes the
    overflow, some documents end up split between memory and disk); a new process over the
    same folder warms it again: every document is reported kept, where its entries are, and
    every prompt finds it."""
    first = _budgeted(make_engine, 4)
    first.warm(SYSTEM_PROMPT + "\n\n")
    assert all(r.kept_in for r in first.warm_documents(DOCS[:16]))
    again = _budgeted(make_engine, 4)
    again.warm(SYSTEM_PROMPT + "\n\n")
    with caplog.at_level(logging.INFO, logger="kvboost_rag.warming.documents"):
        results = again.warm_documents(DOCS[:16])
    assert all(r.kept_in for r in results), [r.kept_in for r in results]
    assert any(len(r.kept_in) == 2 for r in results) or all(r.kept_in == ["disk"] for r in results[2:])
    assert all(set(r.kept_in) <= {"memory", "disk"} for r in results)
    line = next(r.getMessage() for r in caplog.records if "documents kept" in r.getMessage())
    assert line.startswith("warm_documents: 16 of 16 documents kept") and "evicted" not in line
    for i in range(2, 14, 4):
        assert again.generate(rag_prompt(DOCS[i : i + 4]), max_new_tokens=1).documents_found == 4


def test_a_document_split_between_memory_and_disk_is_kept_in_both(make_engine, tmp_path):
    """Its record and first chunk in memory only, its other chunks on disk only: the
    document is kept (``["memory", "disk"]``), not counted evicted; with one chunk in no tier
    it is gone."""
    engine = make_engine("llama", disk_cache_dir=None)
    [result] = engine.warm_documents([DOCS[5]])
    index, memory = engine._cache.index, _memory(engine)
    record = index.find_document(DOCS[5])
    assert result.kept_in == ["memory"] and len(record.chunk_keys) >= 2
    disk = DiskTier(tmp_path / "kv", 10**8)
    engine._cache._store.tiers.append(disk)
    for key in record.chunk_keys[1:]:
        disk.put(key, memory.get(key))
        memory.delete(key)
    assert index.kept_in(record) == ["memory", "disk"]
    disk.delete(record.chunk_keys[-1])
    assert index.kept_in(record) == []


def test_a_chunk_evicted_before_its_record_is_registered_takes_the_record_along(make_engine, monkeypatch):
    """The copier may store a document's chunks, and the memory tier evict one, before the
    request's thread registers the record: the record is dropped then, not kept without it."""
    engine = make_engine("llama", disk_cache_dir=None)
    index, store = engine._cache.index, engine._cache._store
    register, evicted = index.register, []

    def register_after_an_eviction(record):
        engine.flush()  # the chunks reached the tiers first
        if not evicted:
            evicted.append(record.chunk_keys[-1])
            store.delete(record.chunk_keys[-1])  # no record to take along yet
        register(record)

    monkeypatch.setattr(index, "register", register_after_an_eviction)
    results = engine.warm_documents(DOCS[2:5])
    assert evicted, "no record was registered after its chunks were queued"
    check_agreement(engine, memory_only=True)
    assert sum(1 for r in results if r.kept_in) == 2
    assert engine.cache_stats().documents == 2
