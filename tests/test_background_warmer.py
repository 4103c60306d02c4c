"""BackgroundWarmer: the queue both integrations warm retrieved documents with."""

from __future__ import annotations

import time

import pytest

from kvboost_rag.warming.background import BackgroundWarmer


def test_waits_for_answers_to_finish(make_engine, docs) -> None:
    engine = make_engine()
    warmer = BackgroundWarmer(engine, idle_seconds=0.0)
    try:
        warmer.answer_started()
        assert warmer.submit([docs[0], docs[0], "", "  \n"]) == 1  # de-duplicated, blanks skipped
        time.sleep(0.3)
        assert warmer.pending == 1 and engine.cache_stats().documents == 0
        warmer.answer_finished()
        assert warmer.wait_idle(timeout=30)
        assert warmer.warmed_documents == 1 and engine.is_document_warm(docs[0])
    finally:
        warmer.close()


def test_waits_for_the_idle_time_after_the_last_activity(make_engine, docs) -> None:
    engine = make_engine()
    warmer = BackgroundWarmer(engine, idle_seconds=60.0)
    try:
        warmer.submit(docs[:1])
        assert not warmer.wait_idle(timeout=0.3)
        assert warmer.pending == 1 and engine.cache_stats().documents == 0
    finally:
        warmer.close(timeout=5)


def test_already_warm_documents_are_not_counted(make_engine, docs) -> None:
    engine = make_engine()
    engine.warm_documents(docs[:1], show_progress=False)
    warmer = BackgroundWarmer(engine, idle_seconds=0.0)
    try:
        warmer.submit(docs[:2])
        assert warmer.wait_idle(timeout=30)
        assert warmer.warmed_documents == 1
    finally:
        warmer.close()


def test_claim_hands_contained_documents_to_the_answer(make_engine) -> None:
    warmer = BackgroundWarmer(make_engine(), idle_seconds=60.0)
    try:
        warmer.submit(["first document text", "second document text"])
        assert warmer.claim("prompt with first document text inside") == ["first document text"]
        assert warmer.pending == 1 and warmer.claimed_documents == 1
        assert warmer.claim("nothing queued in here") == []
    finally:
        warmer.close()


def test_queue_is_bounded_and_drops_the_oldest(make_engine) -> None:
    warmer = BackgroundWarmer(make_engine(), idle_seconds=60.0, max_pending=2)
    try:
        assert warmer.submit(["one", "two", "three"]) == 3
        assert warmer.pending == 2 and warmer.dropped_documents == 1
        assert warmer.claim("one two three") == ["two", "three"]
    finally:
        warmer.close()


def test_close_drops_or_drains_the_queue(make_engine, docs) -> None:
    dropping = BackgroundWarmer(make_engine(), idle_seconds=60.0)
    dropping.submit(docs[:2])
    dropping.close(timeout=5)
    assert dropping.closed and dropping.pending == 0 and dropping.warmed_documents == 0
    assert dropping.submit(docs[2:3]) == 0  # closed for good

    engine = make_engine()
    draining = BackgroundWarmer(engine, idle_seconds=0.0)
    draining.submit(docs[:2])
    draining.close(timeout=30, drain=True)
    assert draining.warmed_documents == 2 and all(engine.is_document_warm(d) for d in docs[:2])


def test_a_failed_warm_is_counted_and_the_worker_goes_on(make_engine, docs) -> None:
    engine = make_engine()
    calls: list[int] = []
    real = engine.warm_documents

    def flaky(texts, show_progress=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(texts, show_progress=show_progress)

    engine.warm_documents = flaky  # type: ignore[method-assign]
    warmer = BackgroundWarmer(engine, idle_seconds=0.0)
    try:
        warmer.submit(docs[:2])
        assert warmer.wait_idle(timeout=30)
        assert warmer.failed_documents == 1 and warmer.warmed_documents == 1
    finally:
        warmer.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="idle_seconds"):
        BackgroundWarmer(object(), idle_seconds=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending"):
        BackgroundWarmer(object(), max_pending=0)  # type: ignore[arg-type]


EXIT_SCRIPT = """
import sys
from kvboost_rag.dev.testing import tiny_engine
from kvboost_rag.warming.background import BackgroundWarmer
engine = tiny_engine("llama", chunk_size=32, show_progress=False)
warmer = BackgroundWarmer(engine, idle_seconds=0.0)
warmer.submit(["a document queued while the script ends " * 8] + ["another queued one " * 8 + str(i) for i in range(50)])
print("daemon" if warmer._thread.daemon else "no daemon", flush=True)
"""


@pytest.mark.slow
def test_the_warmer_is_no_daemon_and_a_script_that_ends_with_documents_queued_exits_cleanly(tmp_path) -> None:
    """At exit the queue is dropped and the warm in progress finishes: the script ends
    (within the timeout), with no traceback, instead of a thread frozen mid-write."""
    import subprocess
    import sys

    script = tmp_path / "warm_exit.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "no daemon" and "Traceback" not in done.stderr, done.stderr[-2000:]
