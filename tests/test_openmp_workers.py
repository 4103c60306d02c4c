"""Idle OpenMP worker pools given back (:mod:`kvboost_rag.openmp_workers`).

libgomp throttles the spinning of every team's workers once all pools together hold more
threads than it may use CPUs; the engine gives back the pools of the threads that hand it work
and of its own threads when they go idle. The pool must really go (its threads end), the call
must be harmless on a thread without one, and the loop must make it on the caller's thread.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvboost_rag import openmp_workers
from kvboost_rag.dev.testing import tiny_engine
from kvboost_rag.openmp_workers import loaded_gnu_openmp, release_idle_workers


def test_the_gnu_runtime_is_found_in_the_mappings_listed(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n"
        "7f20-7f30 rw-p 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00000000 08:01 456 /opt/env/lib/python3.11/site-packages/torch/lib/libgomp.so.1\n"
    )
    torch_runtime = "/opt/env/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
    assert loaded_gnu_openmp(str(maps)) == [torch_runtime]
    other = "/opt/env/lib/python3.11/site-packages/scikit_learn.libs/libgomp-a34b3233.so.1.0.0"
    maps.write_text(maps.read_text() + f"7f60-7f70 r-xp 00000000 08:01 789 {other}\n7f80-7f90 r--p 00001000 08:01 456 {torch_runtime}\n")
    assert loaded_gnu_openmp(str(maps)) == [torch_runtime, other]  # each once, in mapped order
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/libomp.so.5\n")
    assert loaded_gnu_openmp(str(maps)) == []
    assert loaded_gnu_openmp(str(tmp_path / "absent")) == []


def test_without_the_gnu_runtime_nothing_is_called(monkeypatch):
    openmp_workers._pauses.cache_clear()
    monkeypatch.setattr(openmp_workers, "loaded_gnu_openmp", lambda maps="": [])
    try:
        assert release_idle_workers() is False
    finally:
        openmp_workers._pauses.cache_clear()


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _run_on_a_new_thread(work) -> None:
    """Run ``work`` on a thread of its own, torch at 2 threads meanwhile."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(not loaded_gnu_openmp(), reason="torch runs on another OpenMP runtime here")
def test_a_threads_pool_is_given_back_and_built_again_when_needed():
    seen: dict[str, object] = {}

    def work() -> None:
        before = _threads()
        x = torch.ones(4_000_000)  # a parallel region: this thread's pool, one worker at 2 threads
        seen["workers"] = _threads() - before
        seen["released"] = release_idle_workers()
        seen["left"] = _threads()
        x.add_(1)  # built again
        seen["new workers"] = _threads() - seen["left"]
        seen["sum"] = int(x.sum())
        release_idle_workers()

    _run_on_a_new_thread(work)
    assert seen["released"] is True and seen["sum"] == 2 * 4_000_000
    assert len(seen["workers"]) == 1 and not seen["workers"] & seen["left"]  # its worker ended
    assert len(seen["new workers"]) == 1
    assert release_idle_workers() is True  # harmless on a thread whose pool may be in use or absent


def test_the_loop_gives_back_the_callers_pool_before_its_work(monkeypatch):
    from kvboost_rag.engine_loop import loop

    calls: list[str] = []
    loop_idled = threading.Event()

    def record() -> bool:
        calls.append(threading.current_thread().name)
        if threading.current_thread().name == loop.LOOP_THREAD:
            loop_idled.set()
        return True

    monkeypatch.setattr(loop, "release_idle_workers", record)
    engine = tiny_engine()
    engine.generate("a short prompt about caches", max_new_tokens=2)
    assert threading.current_thread().name in calls  # on the caller's thread, before the loop ran its work
    assert loop_idled.wait(30)  # and on the loop's own thread once it idled


@pytest.mark.skipif(not loaded_gnu_openmp(), reason="torch runs on another OpenMP runtime here")
def test_the_thread_that_built_the_engine_keeps_no_pool():
    """A server loads the model on its main thread and hands requests over on others: the
    loading thread's pool would outlive the load, and the engine loop's workers would sleep
    between regions for ever after (a decode step ~1.5x as long, measured in the server)."""
    seen: dict[str, set[str]] = {}

    def build() -> None:
        before = _threads()
        torch.ones(4_000_000).add_(1)  # this thread's pool, as loading the weights makes it
        seen["workers"] = _threads() - before
        tiny_engine()  # its checks at load run torch on this thread too
        seen["left"] = _threads()

    _run_on_a_new_thread(build)
    assert len(seen["workers"]) == 1
    assert not seen["workers"] & seen["left"]  # the pool's worker ended with the construction
