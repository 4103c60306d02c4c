"""The write-back off the answer's path: a call returns at its last token, what it stored is
found at once by the next request (on this thread or any other), the tiers get it on the
write-back's worker (no put and no serialization on the request's thread), a blocked tier holds
up no call, ``flush`` waits for it all, and the host memory of stored chunks is reused.

Gates (events a tier's ``put`` waits for) hold the worker back, so every check of "found before
the tiers hold it" is deterministic, not a race.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from devices import DEVICES
from rag_prompts import SYSTEM_PROMPT, rag_prompt

import kvboost_rag.cache.storage.disk as disk_module
from kvboost_rag.host_memory.arena import HostArena
from kvboost_rag.cache.storage import DiskTier
from kvboost_rag.cache.write_worker import THREAD_NAME
from kvboost_rag.corpus import python_reference_documents

DOCS = python_reference_documents(max_chars=300)[:48]


@contextmanager
def gated_puts(tier) -> Iterator[threading.Event]:
    """Every ``put`` into ``tier`` waits until the yielded event is set (it is set on leaving)."""
    opened = threading.Event()
    original = tier.put

    def put(key, entry):
        assert opened.wait(60), "the gate was never opened"
        return original(key, entry)

    tier.put = put
    try:
        yield opened
    finally:
        opened.set()


def _host_tiers(engine):
    return [tier for tier in engine._cache._store.tiers if tier.name != "device"]


def _reordered(docs: list[str]) -> list[str]:
    return docs[1:] + docs[:1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_call_puts_and_serializes_nothing_on_its_own_thread(make_engine, device, tmp_path, monkeypatch):
    """A counting store: every put into a host tier and every serialization, with the thread
    that made it. A warmed system prompt, then a call with new documents: none on the caller's
    thread; after ``flush`` the worker made them all."""
    engine = make_engine("llama", disk_cache_dir=tmp_path / "kv")  # write-through: every entry serialized
    engine.warm(SYSTEM_PROMPT + "\n\n")
    calls: list[tuple[str, threading.Thread]] = []
    for tier in _host_tiers(engine):
        original = tier.put
        monkeypatch.setattr(tier, "put", lambda key, entry, o=original, n=tier.name: (calls.append((n, threading.current_thread())), o(key, entry))[1])
    serialize = disk_module.serialize_parts
    monkeypatch.setattr(
        disk_module, "serialize_parts", lambda *a, **k: (calls.append(("serialize", threading.current_thread())), serialize(*a, **k))[1]
    )
    docs = DOCS[:4]
    result = engine.generate(rag_prompt(docs), max_new_tokens=4, documents=docs)
    streamed = engine.stream(rag_prompt(DOCS[4:7]), max_new_tokens=4, documents=DOCS[4:7])
    pieces = list(streamed)
    caller = threading.current_thread()
    assert [name for name, thread in calls if thread is caller] == []
    assert engine.flush(timeout=60)
    assert result.content_hit_tokens == 0 and pieces and streamed.result is not None
    names = {name for name, _ in calls}
    assert {"memory", "disk", "serialize"} <= names, names
    # The worker's thread (a new one once the last ended after LINGER_SECONDS idle, as on a slow machine).
    assert all(thread.name.startswith(THREAD_NAME) for _, thread in calls), {thread.name for _, thread in calls}


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_request_finds_every_document_before_the_tiers_hold_it(make_engine, device):
    """The memory tier's puts wait at a gate: the first call still returns, and the same
    documents in a new order are found from what it staged, with the logits and tokens the
    stored entries give once the gate opens."""
    engine = make_engine("llama")
    store = engine._cache._store
    docs = DOCS[8:12]
    with gated_puts(store.memory_tier):
        first = engine.generate(rag_prompt(docs), max_new_tokens=4, documents=docs)
        assert store.staged_count > 0 and first.content_hit_tokens == 0
        staged = engine.generate(rag_prompt(_reordered(docs)), max_new_tokens=6, documents=_reordered(docs), return_logits=True)
        assert not engine._cache.writer.idle  # the first call's puts still wait
    assert engine.flush(timeout=60)
    assert store.staged_count == 0
    stored = engine.generate(rag_prompt(_reordered(docs)), max_new_tokens=6, documents=_reordered(docs), return_logits=True)
    assert staged.content_hit_tokens > 0
    assert staged.content_hit_tokens == stored.content_hit_tokens
    assert torch.equal(staged.first_token_logits, stored.first_token_logits)
    assert staged.token_ids == stored.token_ids


def test_a_lookup_while_the_copier_is_held_copies_the_staged_views_and_the_buffers_go_back_after(make_engine, monkeypatch):
    """The copier waits at a gate: the first call's buffers stay lent (its job holds them),
    the next request finds its documents from the staged views, and once the copier staged
    its copies the buffers go back; the answers are those the stored entries give."""
    engine = make_engine("llama")
    copies, pool = engine._cache.copies, engine._requests.memory.host_buffers
    opened, to_host = threading.Event(), copies.to_host
    monkeypatch.setattr(copies, "to_host", lambda tensors: (opened.wait(60), to_host(tensors))[1])
    docs = DOCS[44:47]
    try:
        engine.generate(rag_prompt(docs), max_new_tokens=4, documents=docs)
        held = pool.lent_bytes
        staged = engine.generate(rag_prompt(_reordered(docs)), max_new_tokens=6, documents=_reordered(docs), return_logits=True)
        assert held > 0 and pool.lent_bytes >= held  # the first call's buffers wait for the copier
    finally:
        opened.set()
    assert engine.flush(timeout=60) and pool.lent_bytes == 0
    stored = engine.generate(rag_prompt(_reordered(docs)), max_new_tokens=6, documents=_reordered(docs), return_logits=True)
    assert staged.content_hit_tokens > 0 and staged.content_hit_tokens == stored.content_hit_tokens
    assert torch.equal(staged.first_token_logits, stored.first_token_logits)
    assert staged.token_ids == stored.token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_eight_threads_each_find_what_their_own_call_stored(make_engine, device):
    """Eight threads at once, each with documents of its own: right after its call returns, each
    finds every document it stored (the worker held at a gate), as many tokens as after flush."""
    engine = make_engine("llama", max_batch_size=8)
    groups = [DOCS[12 + 3 * i : 15 + 3 * i] for i in range(8)]
    barrier = threading.Barrier(8)

    def ask(docs: list[str]) -> int:
        barrier.wait(timeout=60)
        engine.generate(rag_prompt(docs), max_new_tokens=3, documents=docs)
        return engine.generate(rag_prompt(_reordered(docs)), max_new_tokens=1, documents=_reordered(docs)).content_hit_tokens

    with gated_puts(engine._cache._store.memory_tier), ThreadPoolExecutor(8) as pool:
        found = list(pool.map(ask, groups))
    assert engine.flush(timeout=60)
    after = [engine.generate(rag_prompt(_reordered(d)), max_new_tokens=1, documents=_reordered(d)).content_hit_tokens for d in groups]
    assert found == after and all(found)


@pytest.mark.parametrize("device", DEVICES)
def test_a_blocked_disk_tier_holds_up_no_call_and_flush_waits_for_it(make_engine, device, tmp_path):
    """Every disk write waits at a gate: calls still return (streamed and blocking), flush
    with a timeout says the writes are not done, and once the gate opens they reach the disk."""
    engine = make_engine("llama", disk_cache_dir=tmp_path / "kv")
    disk = next(tier for tier in engine._cache._store.tiers if isinstance(tier, DiskTier))
    docs = DOCS[36:39]
    with gated_puts(disk):
        result = engine.generate(rag_prompt(docs), max_new_tokens=4, documents=docs)
        assert "".join(engine.stream(rag_prompt(DOCS[39:41]), max_new_tokens=3, documents=DOCS[39:41]))
        assert not engine.flush(timeout=0.2)  # the gate is closed: cannot finish
        assert result.generated_tokens > 0
    assert engine.flush(timeout=60)
    assert engine.is_document_warm(docs[0]) and len(disk) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_clear_cache_waits_for_the_queued_writes_and_drops_them(make_engine, device):
    engine = make_engine("llama")
    docs = DOCS[41:44]
    engine.generate(rag_prompt(docs), max_new_tokens=2, documents=docs)
    engine.clear_cache()
    store = engine._cache._store
    assert store.staged_count == 0 and not list(store.memory_tier.keys())
    again = engine.generate(rag_prompt(docs), max_new_tokens=2, documents=docs)
    assert again.content_hit_tokens == 0


@pytest.mark.parametrize("device", DEVICES)
def test_storing_chunks_in_steady_state_allocates_no_host_memory(make_engine, device):
    """A memory tier that holds about two prompts' documents, an arena whose segments hold one:
    rounds of new documents evict old ones, their ranges come back, and after a few rounds no
    round adds a segment, although every stored chunk went through the arena."""
    probe = make_engine("llama", disk_cache_dir=None)
    per_token = probe._cache.bytes_per_token()
    rounds = [DOCS[i : i + 3] for i in range(0, 36, 3)]
    prompt_bytes = int(max(sum(probe.count_tokens(d) for d in docs) for docs in rounds) * per_token)
    engine = make_engine("llama", disk_cache_dir=None, max_cache_bytes=2 * prompt_bytes)
    copies = engine._cache.copies
    copies.arena = arena = HostArena(copies.arena.dtype, pinned=copies.arena.pinned, segment_bytes=prompt_bytes)
    segments = []
    for docs in rounds:
        engine.generate(rag_prompt(docs), max_new_tokens=1, documents=docs)
        assert engine.flush(timeout=60)
        segments.append(arena.segments)
    stats = engine.cache_stats()
    assert stats.counters["documents_evicted"] > 0  # the budget really evicted
    assert segments[-1] == segments[len(segments) // 2], segments  # steady: no new segment
    assert arena.tensors_taken == 2 * stats.counters["stored_entries"]  # K and V of every stored chunk
    memory = engine._cache._store.memory_tier
    chunks = [entry for key in memory.keys() if "keys" in (entry := memory.get(key)).tensors]
    assert chunks and all(entry.tensors["keys"].is_pinned() == (device == "cuda") for entry in chunks)
