"""Lent buffers go back by name: a counted hold, and staged views a lookup copies out."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.cache.storage import MemoryTier, TieredStore
from kvboost_rag.cache.storage.base import LentEntry
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
