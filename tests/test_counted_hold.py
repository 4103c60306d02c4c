"""Lent buffers go back by name: a counted hold, and staged views a lookup copies out (or\nwaits for the write-back's copy of, once the copier took them)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvboost_rag.cache.storage import MemoryTier, StoredEntry, TieredStore, tiered
from kvboost_rag.cache.storage.base import CopyUnderWay, LentEntry
from kvboost_rag.host_memory.counted_hold import CountedHold


def test_the_last_release_gives_the_memory_back_once_and_a_second_release_fails():
    back: list[int] = []
    hold = CountedHold(lambda: back.append(1))
    assert hold.acquire() and hold.held
    hold.release()
    assert back == [] and hold.held  # the first holder's reference is left
    hold.release()
    assert back == [1] and not hold.held
    assert not hold.acquire()  # nothing to hold any more
    with pytest.raises(RuntimeError, match="released more often"):
        hold.release()
    assert back == [1]


def _staged_view(store: TieredStore, buffer: torch.Tensor, back: list[int]) -> LentEntry:
    hold = CountedHold(lambda: back.append(1))
    entry = LentEntry({"keys": buffer[:, :4], "values": buffer[:, 4:]}, {"start_position": "0"}, hold=hold)
    store.stage("chunk", entry)
    return entry


def test_a_lookup_of_a_staged_view_gets_a_copy_and_holds_no_view_of_the_lent_buffer():
    store = TieredStore([MemoryTier(1 << 20)])
    buffer = torch.arange(16.0).reshape(2, 8)
    back: list[int] = []
    entry = _staged_view(store, buffer, back)
    found, trusted = store.fetch("chunk")
    assert trusted and torch.equal(found.tensors["keys"], buffer[:, :4])
    assert found.tensors["keys"].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    store.settle("chunk", entry)
    entry.hold.release()  # the write-back's job lets go: nothing else holds the buffer
    assert back == [1]
    buffer.fill_(-1.0)  # the next request writes into it
    assert torch.equal(found.tensors["keys"], torch.arange(16.0).reshape(2, 8)[:, :4])


def test_a_staged_view_whose_buffer_went_back_is_an_error_not_a_read():
    store = TieredStore([MemoryTier(1 << 20)])
    back: list[int] = []
    entry = _staged_view(store, torch.zeros(2, 8), back)
    entry.hold.release()  # wrongly released while still staged
    with pytest.raises(RuntimeError, match="outlived"):
        store.fetch("chunk")


def _staged_view_being_copied(store: TieredStore, buffer: torch.Tensor) -> LentEntry:
    entry = LentEntry(
        {"keys": buffer[:, :4], "values": buffer[:, 4:]}, {"start_position": "0"},
        hold=CountedHold(lambda: None), copy=CopyUnderWay(),
    )
    store.stage("chunk", entry)
    return entry


def _fetched_while_copying(store: TieredStore, entry: LentEntry, chunks_before: int) -> tuple[StoredEntry, StoredEntry]:
    """What a lookup of ``entry`` gets while a copier, started on its job, stages ``chunks_before``
    other copies and then ``entry``'s, one every 0.2 s; and that copy."""
    owned = StoredEntry({name: t.clone() for name, t in entry.tensors.items()}, dict(entry.metadata))
    entry.copy.start()

    def copier() -> None:
        for _ in range(chunks_before):
            time.sleep(0.2)
            entry.copy.advance()
        time.sleep(0.2)
        assert store.restage("chunk", entry, owned)
        entry.copy.advance()

    thread = threading.Thread(target=copier)
    thread.start()
    found, trusted = store.fetch("chunk")
    thread.join()
    assert trusted
    return found, owned


def test_a_lookup_of_a_view_whose_copy_has_started_reads_the_copiers_copy_not_one_of_its_own(monkeypatch):
    monkeypatch.setattr(tiered, "COPY_STALL_SECONDS", 1.0)
    store = TieredStore([MemoryTier(1 << 20)])
    found, owned = _fetched_while_copying(store, _staged_view_being_copied(store, torch.arange(16.0).reshape(2, 8)), 0)
    assert found is owned  # waited for the copier's copy, made none of its own


def test_a_view_whose_copy_is_queued_or_stalled_is_copied_by_the_lookup_and_a_stall_is_waited_for_once(monkeypatch):
    monkeypatch.setattr(tiered, "COPY_STALL_SECONDS", 1.0)
    store = TieredStore([MemoryTier(1 << 20)])
    buffer = torch.arange(16.0).reshape(2, 8)
    entry = _staged_view_being_copied(store, buffer)
    started = time.perf_counter()
    queued, _ = store.fetch("chunk")  # the copier has not taken the job: no wait
    assert time.perf_counter() - started < 0.9
    entry.copy.start()  # taken, but no copy comes
    stalled, _ = store.fetch("chunk")
    waited = time.perf_counter() - started
    again, _ = store.fetch("chunk")
    assert 1.0 <= waited and time.perf_counter() - started - waited < 0.9  # the second lookup does not wait
    for found in (queued, stalled, again):
        assert found is not entry and torch.equal(found.tensors["keys"], buffer[:, :4])
        assert found.tensors["keys"].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_a_lookup_waiting_for_a_copy_whose_job_fails_gets_what_the_tiers_hold(monkeypatch):
    monkeypatch.setattr(tiered, "COPY_STALL_SECONDS", 1.0)
    store = TieredStore([MemoryTier(1 << 20)])
    entry = _staged_view_being_copied(store, torch.zeros(2, 8))
    entry.copy.start()

    def failing_copier() -> None:
        time.sleep(0.2)
        store.settle("chunk", entry)  # the job failed: its views are unstaged
        entry.copy.finish()
        entry.hold.release()

    thread = threading.Thread(target=failing_copier)
    thread.start()
    assert store.fetch("chunk") is None  # a miss, not a read of a buffer that went back
    thread.join()


def test_a_lookup_waits_as_long_as_the_copier_keeps_staging_copies(monkeypatch):
    monkeypatch.setattr(tiered, "COPY_STALL_SECONDS", 1.0)
    store = TieredStore([MemoryTier(1 << 20)])
    found, owned = _fetched_while_copying(store, _staged_view_being_copied(store, torch.arange(16.0).reshape(2, 8)), 5)
    assert found is owned  # 1.2 s in all, longer than the stall bound, but never that long without a copy
