"""Bounded indexes and documents found by a fresh process over the same store.

The document registry and the prefix index live within ``max_cache_bytes`` and leave with the
entries they describe; what finds a document (its text, tokens and spans) is stored in the tiers,
so an engine started over the same disk folder finds stored documents in prompts with no
re-registration, and re-warming stored documents reads no K/V.
"""

from __future__ import annotations

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost
from kvboost_rag.cache.codec import CorruptEntryError
from kvboost_rag.cache.document_records import (
    DocumentShelf,
    record_from_entry,
    record_to_entry,
)
from kvboost_rag.cache.storage import DiskTier, MemoryTier, StoredEntry, TieredStore
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.request.documents import make_record

PER_TOKEN = 2 * 3 * 2 * 16 * 4  # K+V x layers x kv heads x head_dim x fp32 of the tiny llama


def _engine(model, tokenizer, **settings) -> KVBoost:
    settings.setdefault("show_progress", False)
    settings.setdefault("chunk_size", 32)
    return KVBoost.from_model(model, tokenizer, **settings)


def test_registry_and_prefix_index_stay_within_the_memory_budget(make_engine, tokenizer):
    budget = PER_TOKEN * 300
    engine = make_engine("llama", max_cache_bytes=budget, disk_cache_dir=None)
    novel = python_reference_documents(max_chars=240)[:40]
    for i, doc in enumerate(novel):
        engine.generate(rag_prompt([doc]), max_new_tokens=1, documents=[doc])
        engine.generate(f"Chat {i}: tell me something new about topic number {i * 7919}.", max_new_tokens=1)
    stats = engine.cache_stats()
    store = engine._cache._store
    # Everything the process holds for the cache counts against the one budget.
    assert stats.memory_bytes <= budget
    assert stats.index_bytes > 0
    # Documents are known only while their stored record is: far fewer than were seen.
    assert 0 < stats.documents < len(novel)
    shelf = engine._cache.index.shelf
    assert all(store.contains(shelf.key_of(a, d)) for a, d in engine._cache.index.known_documents().known())
    # The prefix index describes only stored chunks.
    assert 0 < stats.prefix_index_entries <= stats.entries
    assert all(store.contains(key) for key in engine._cache.index.prefixes.keys())


def test_fresh_engine_over_the_same_disk_folder_finds_stored_documents(tokenizer, docs, tmp_path):
    model = tiny_model("llama")
    first = _engine(model, tokenizer, disk_cache_dir=tmp_path)
    first.warm(SYSTEM_PROMPT)
    first.warm_documents(docs[:3])
    first._cache._store.close()

    restarted = _engine(model, tokenizer, disk_cache_dir=tmp_path)
    assert restarted.cache_stats().documents == 3
    result = restarted.generate(rag_prompt([docs[2], docs[0], docs[1]]), max_new_tokens=2)
    assert result.documents_found == 3
    assert result.content_hit_tokens > 0


def test_warming_stored_documents_in_a_fresh_engine_reads_no_kv(tokenizer, docs, tmp_path):
    model = tiny_model("llama")
    first = _engine(model, tokenizer, disk_cache_dir=tmp_path, warm_prefix=SYSTEM_PROMPT)
    first.warm_documents(docs[:3])

    restarted = _engine(model, tokenizer, disk_cache_dir=tmp_path, warm_prefix=SYSTEM_PROMPT)
    read: list[str] = []
    for tier in restarted._cache._store.tiers:
        original = tier.get

        def spy(key, _get=original):
            entry = _get(key)
            if entry is not None:
                read.append(entry.metadata.get("kind", "kv"))
            return entry

        tier.get = spy
    results = restarted.warm_documents(docs[:3])
    assert all(r.already_warm and r.new_tokens == 0 for r in results)
    assert "kv" not in read


def test_stored_document_record_round_trips_and_rejects_tampering(tokenizer, docs):
    enc = tokenizer(docs[0], add_special_tokens=False, return_offsets_mapping=True)
    record = make_record(docs[0], enc["input_ids"], enc["offset_mapping"], "fp-a", 16)
    entry = record_to_entry(record, "fp-a")
    assert record_from_entry(entry, "fp-a", 16) == record
    with pytest.raises(CorruptEntryError, match="fingerprint"):
        record_from_entry(entry, "fp-b", 16)
    tampered = dict(entry.tensors)
    tampered["text"] = tampered["text"].clone()
    tampered["text"][0] ^= 1
    with pytest.raises(CorruptEntryError, match="digest"):
        record_from_entry(type(entry)(tampered, dict(entry.metadata)), "fp-a", 16)
    backwards = dict(entry.tensors)
    backwards["offsets"] = torch.flip(backwards["offsets"], [0])
    with pytest.raises(CorruptEntryError, match="spans"):
        record_from_entry(type(entry)(backwards, dict(entry.metadata)), "fp-a", 16)


def test_shelf_lists_only_its_own_fingerprint(tokenizer, docs):
    store = TieredStore([MemoryTier(10**7)])
    enc = tokenizer(docs[0], add_special_tokens=False, return_offsets_mapping=True)
    mine, theirs = DocumentShelf(store, "fp-a", 16), DocumentShelf(store, "fp-b", 16)
    mine.save(make_record(docs[0], enc["input_ids"], enc["offset_mapping"], "fp-a", 16))
    assert len(list(mine.stored())) == 1
    assert list(theirs.stored()) == []


def _kv(tokens: int) -> StoredEntry:
    return StoredEntry(tensors={"keys": torch.zeros(tokens, 8)})


def test_memory_reservation_counts_against_the_budget_and_evicts():
    tier = MemoryTier(max_bytes=4 * 32 * 10)
    for i in range(4):
        tier.put(f"k{i}", _kv(10))
    assert tier.used_bytes == 4 * 320
    evicted = tier.reserve("indexes", 500)
    assert len(evicted) == 2 and len(tier) == 2
    assert tier.used_bytes == 2 * 320 + 500 <= tier.max_bytes
    assert tier.put("big", _kv(30)) == [] and "big" not in tier  # 960 > 1280 - 500
    tier.reserve("indexes", 0)
    assert tier.used_bytes == 2 * 320


def test_store_reports_keys_that_left_every_tier(tmp_path):
    memory = MemoryTier(max_bytes=320)
    store = TieredStore([memory, DiskTier(tmp_path, max_bytes=10**6)])
    gone: list[str] = []
    store.on_gone(gone.append)
    store.put("a", _kv(10))
    store.put("b", _kv(10))  # evicts "a" from memory only: the disk still holds it
    assert "a" not in memory and gone == []
    store.delete("a")
    assert gone == ["a"]
    only_memory = TieredStore([MemoryTier(max_bytes=320)])
    only_memory.on_gone(gone.append)
    only_memory.put("c", _kv(10))
    only_memory.put("d", _kv(10))
    assert gone == ["a", "c"]
    assert sorted(store.keys_with_prefix("b")) == ["b"]


def test_parsed_records_are_served_from_memory_and_leave_with_their_entry(tokenizer):
    """The shelf keeps the records it read parsed (no decoding and checking at every prompt),
    bounded by tokens, and forgets one when its entry leaves every tier."""
    store = TieredStore([MemoryTier(64 * 1024**2)])
    shelf = DocumentShelf(store, "fp", chunk_size=16)
    texts = python_reference_documents(max_chars=300)[:3]
    records = []
    for text in texts:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        records.append(make_record(text, enc.input_ids, [tuple(o) for o in enc.offset_mapping], "fp", 16))
        shelf.save(records[-1])
    from kvboost_rag.request.documents import anchor_of

    first = shelf.load(anchor_of(texts[0]), records[0].digest)
    assert first is shelf.load(anchor_of(texts[0]), records[0].digest)  # the same parsed object
    store.delete(shelf.key_of(anchor_of(texts[0]), records[0].digest))
    assert shelf.load(anchor_of(texts[0]), records[0].digest) is None  # gone with its entry
    small = DocumentShelf(store, "fp", chunk_size=16)
    small.parsed.max_tokens = max(len(records[1].token_ids), len(records[2].token_ids))  # one record fits
    assert small.load(anchor_of(texts[1]), records[1].digest) is not None
    assert small.load(anchor_of(texts[2]), records[2].digest) is not None
    assert small.parsed.get(records[1].digest) is None and small.parsed.get(records[2].digest) is not None
