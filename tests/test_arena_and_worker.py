"""The write-back's parts on their own: the host arena (ranges handed out, taken back when
their tensor and every view are collected, merged, reused, free segments given back) and the
worker (order, flush, failures, a first-come bound on queued bytes, work queued from a job,
close, a thread that ends when idle)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from kvboost_rag.host_memory.arena import HostArena
from kvboost_rag.cache.write_worker import THREAD_NAME, WriteWorker


def _arena(elements: int = 1024) -> HostArena:
    return HostArena(torch.float32, segment_bytes=4 * elements)


def test_tensors_of_the_arena_are_contiguous_and_apart():
    arena = _arena()
    a, b = arena.take((4, 8)), arena.take((3, 5))
    assert a.is_contiguous() and b.shape == (3, 5) and b.is_contiguous()
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.all(a == 1.0) and torch.all(b == 2.0)
    assert arena.segments == 1 and arena.tensors_taken == 2
    assert arena.used_bytes >= (32 + 15) * 4


def test_a_range_comes_back_only_when_its_tensor_and_every_view_are_collected_and_is_reused():
    arena = _arena()
    first = arena.take((256,))
    address = first.data_ptr()
    view = first[:10]  # a view holds the range
    del first
    gc.collect()
    assert arena.used_bytes == 256 * 4
    again = arena.take((256,))
    assert again.data_ptr() != address  # the range is still taken
    del view, again
    gc.collect()
    assert arena.used_bytes == 0
    reused = arena.take((256,))
    assert reused.data_ptr() == address and arena.segments == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_with_torch_asked_to_fill_new_memory_every_range_is_filled_when_taken_and_reused(dtype, monkeypatch):
    """The suites run with torch's fill of new memory on: a range handed out again holds the
    fill, not the earlier tensor's values, and a new segment is filled range by range."""
    arena = HostArena(dtype, segment_bytes=8 * 1024)
    first = arena.take((64,))
    fill = torch.tensor(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max, dtype=dtype)
    assert torch.equal(first, fill.expand(64)) or (dtype.is_floating_point and bool(first.isnan().all()))
    first.fill_(3)
    address = first.data_ptr()
    del first
    gc.collect()
    again = arena.take((64,))
    assert again.data_ptr() == address
    assert bool(again.isnan().all()) if dtype.is_floating_point else bool((again == torch.iinfo(dtype).max).all())
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", False)
    again.fill_(5)
    del again
    gc.collect()
    assert bool((arena.take((64,)) == 5).all())  # without the fill a reused range keeps what it held


def test_a_view_reads_what_was_written_while_a_later_tensor_takes_other_memory():
    arena = _arena(512)
    first = arena.take((256,))
    first.fill_(7.0)
    kept = first.view(16, 16)[3:5]
    del first
    gc.collect()
    later = arena.take((256,))
    later.fill_(-1.0)
    assert torch.all(kept == 7.0)


def test_tensors_of_every_dtype_are_carved_with_their_own_element_size():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        arena = HostArena(dtype, segment_bytes=4096)
        tensor = arena.take((3, 5))
        assert tensor.dtype == dtype and tensor.shape == (3, 5) and tensor.is_contiguous()
        assert tensor.data_ptr() % 64 == 0


def test_wholly_free_segments_go_back_to_the_system_but_one_spare():
    arena = _arena(256)
    parts = [arena.take((256,)) for _ in range(3)]  # a segment each
    assert arena.segments == 3 and arena.segment_bytes == 3 * 1024
    del parts[:]
    gc.collect()
    assert arena.segments == 1 and arena.used_bytes == 0  # one spare kept for the next writes
    assert arena.trim() == 1024 and arena.segments == 0 and arena.segment_bytes == 0


def test_freed_neighbours_merge_so_a_larger_request_fits_without_a_new_segment():
    arena = _arena(1024)
    parts = [arena.take((256,)) for _ in range(4)]  # the whole segment
    assert arena.segments == 1
    del parts[1], parts[1]  # the two middle ranges
    gc.collect()
    merged = arena.take((512,))
    assert arena.segments == 1 and merged.data_ptr() == parts[0].data_ptr() + 256 * 4
    bigger = arena.take((4096,))  # larger than a segment: one of its own
    assert arena.segments == 2 and bigger.numel() == 4096


def test_the_arena_is_safe_from_several_threads():
    arena = _arena(1 << 14)

    def churn() -> None:
        for _ in range(300):
            tensor = arena.take((37,))
            tensor.fill_(3.0)
            assert torch.all(tensor == 3.0)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert arena.used_bytes == 0 and arena.tensors_taken == 1200


class _CollectingFreeList(list):
    """A segment's free list that drops the arena's last outside tensor the first time the
    arena writes an entry of it: as if the collector ran a finalizer on the allocation of the
    entry, in the middle of a ``take``."""

    def __init__(self, entries, held: list) -> None:
        super().__init__(entries)
        self.held = held

    def __setitem__(self, index, value) -> None:
        if self.held:
            self.held.clear()  # its range comes back now, on this thread, inside the arena
        super().__setitem__(index, value)


def _ranges_partition(arena: HostArena, live: list[torch.Tensor]) -> bool:
    """Whether the free ranges and the live tensors' ranges tile the arena's one segment."""
    (segment,) = arena._segments
    base = segment.storage.data_ptr()
    spans = [(t.data_ptr() - base, -(-t.numel() * t.element_size() // 64) * 64) for t in live]
    spans += list(segment.free)
    spans.sort()
    covered = 0
    for start, length in spans:
        if start != covered:
            return False
        covered += length
    return covered == segment.nbytes


def test_a_range_coming_back_in_the_middle_of_a_take_is_neither_lost_nor_lent_twice():
    arena = _arena(1024)
    first = arena.take((16,))  # 64 bytes
    (segment,) = arena._segments
    segment.free = _CollectingFreeList(segment.free, [first])
    del first
    second = arena.take((16,))
    gc.collect()
    assert arena.used_bytes == 64
    assert _ranges_partition(arena, [second])
    third = arena.take((16,))
    assert third.data_ptr() != second.data_ptr() and _ranges_partition(arena, [second, third])


def test_jobs_run_in_order_on_one_thread_and_flush_waits_for_them():
    worker = WriteWorker(max_queued_bytes=1 << 20)
    gate, seen = threading.Event(), []
    worker.submit(lambda: gate.wait(60))
    for i in range(5):
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    assert not worker.flush(timeout=0.05)  # the first job still waits
    gate.set()
    assert worker.flush(timeout=60)
    assert [i for i, _ in seen] == list(range(5)) and len({name for _, name in seen}) == 1
    assert seen[0][1].startswith(THREAD_NAME)
    assert worker.completed == 6 and worker.idle


def test_a_flush_waits_for_the_jobs_before_it_and_not_for_those_queued_meanwhile():
    """Under a steady load (every request queues a job) a flush still returns."""
    waiting = threading.Event()

    class NotedWaits(threading.Condition):
        def wait(self, timeout=None):
            waiting.set()  # the flush took its target and waits
            return super().wait(timeout)

    worker = WriteWorker(max_queued_bytes=1 << 20)
    worker._state = NotedWaits()
    first, later, flushed = threading.Event(), threading.Event(), threading.Event()
    worker.submit(lambda: first.wait(60))
    flusher = threading.Thread(target=lambda: worker.flush(timeout=60) and flushed.set())
    flusher.start()
    assert waiting.wait(60)
    worker.submit(lambda: later.wait(60))  # queued after the flush began
    first.set()
    flusher.join(60)
    assert flushed.is_set() and not worker.idle  # the later job still runs
    later.set()
    assert worker.flush(timeout=60) and worker.idle


def test_two_workers_each_know_their_own_thread():
    one, other = WriteWorker(max_queued_bytes=1 << 20), WriteWorker(max_queued_bytes=1 << 20)
    seen = []
    one.submit(lambda: seen.append((one.on_worker(), other.on_worker())))
    assert one.flush(timeout=60) and seen == [(True, False)]


def test_a_failing_job_is_counted_and_the_next_runs(caplog):
    worker = WriteWorker(max_queued_bytes=1 << 20)
    ran = []
    worker.submit(lambda: 1 / 0)
    worker.submit(lambda: ran.append(1))
    assert worker.flush(timeout=60)
    assert worker.errors == 1 and ran == [1]
    assert "ZeroDivisionError" in caplog.text


def test_a_submit_waits_while_the_queued_bytes_exceed_the_bound():
    worker = WriteWorker(max_queued_bytes=100)
    gate = threading.Event()
    worker.submit(lambda: gate.wait(60), nbytes=10)  # running: no longer queued
    worker.submit(lambda: None, nbytes=80)
    submitted = threading.Event()

    def third() -> None:
        worker.submit(lambda: None, nbytes=50)  # 80 + 50 > 100: waits for the queue
        submitted.set()

    thread = threading.Thread(target=third)
    thread.start()
    assert not submitted.wait(0.2)
    gate.set()
    assert submitted.wait(60)
    thread.join()
    assert worker.flush(timeout=60) and worker.completed == 3


def test_work_queued_from_a_job_runs_in_place_and_flush_from_the_worker_returns():
    worker = WriteWorker(max_queued_bytes=1 << 20)
    order = []

    def outer() -> None:
        worker.submit(lambda: order.append("inner"))
        assert worker.flush(timeout=1)  # from the worker itself: returns at once
        order.append("outer")

    worker.submit(outer)
    assert worker.flush(timeout=60) and order == ["inner", "outer"]


def test_a_closed_worker_runs_later_jobs_on_their_callers_thread():
    worker = WriteWorker(max_queued_bytes=1 << 20)
    ran = []
    worker.submit(lambda: ran.append(threading.current_thread().name))
    assert worker.close(timeout=60) and ran[0].startswith(THREAD_NAME)
    worker.submit(lambda: ran.append(threading.current_thread().name))
    assert ran[1] == threading.current_thread().name and worker.completed == 2


def test_a_large_job_is_not_passed_for_ever_by_smaller_ones():
    """First come first served: once the large job waits, later small ones wait behind it."""
    worker = WriteWorker(max_queued_bytes=100)
    gate = threading.Event()
    order: list[str] = []
    worker.submit(lambda: gate.wait(60), nbytes=60)
    large_waiting = threading.Event()

    def large() -> None:
        large_waiting.set()
        worker.submit(lambda: order.append("large"), nbytes=90)

    thread = threading.Thread(target=large)
    thread.start()
    assert large_waiting.wait(60)
    while not worker._arrivals:  # the large submit is in line
        threading.Event().wait(0.01)
    small = threading.Thread(target=lambda: worker.submit(lambda: order.append("small"), nbytes=10))
    small.start()
    gate.set()
    thread.join(60)
    small.join(60)
    assert worker.flush(timeout=60) and order == ["large", "small"]


def test_a_flush_waits_for_every_job_queued_before_it_by_any_thread():
    """Queuing is one step under the lock: no job counted before it is queued."""
    worker = WriteWorker(max_queued_bytes=1 << 20)
    done: list[int] = []
    gate = threading.Event()
    worker.submit(lambda: gate.wait(60))

    def submitter(i: int) -> None:
        worker.submit(lambda: done.append(i))

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    gate.set()
    assert worker.flush(timeout=60) and sorted(done) == list(range(8))


def test_the_thread_ends_when_idle_and_starts_again_for_the_next_job():
    worker = WriteWorker(max_queued_bytes=1 << 20)
    names: list[threading.Thread] = []
    worker.submit(lambda: names.append(threading.current_thread()))
    assert worker.flush(timeout=60)
    names[0].join(60)  # it lingers, then ends
    assert not names[0].is_alive() and names[0].daemon  # a daemon: exit waits for it only EXIT_FLUSH_SECONDS
    worker.submit(lambda: names.append(threading.current_thread()))
    assert worker.flush(timeout=60) and names[1] is not names[0] and names[1].name == THREAD_NAME
