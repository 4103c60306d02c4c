"""The warm job: sources, one-process runs, the command line, and Ray runs on a Redis Cluster.

Engines are the tiny random-weight llama (``kvboost_rag.dev.testing:tiny_engine``), so a few
hundred documents warm in seconds; the Ray tests start a local Ray instance with 2 workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from kvboost_rag.corpus import python_reference_topics
from kvboost_rag.dev.testing import tiny_engine
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.warm_job import EngineSpec, SourceDocument, read_source, warm_corpus

ROOT = Path(__file__).resolve().parents[1]
FACTORY = "kvboost_rag.dev.testing:tiny_engine"


def _corpus(count: int, chars: int = 300) -> list[dict[str, str]]:
    """``count`` distinct pieces of the Python reference documentation."""
    rows, seen = [], set()
    for name, text in python_reference_topics().items():
        for start in range(0, len(text) - 100, chars):
            piece = text[start : start + chars]
            if piece not in seen:
                seen.add(piece)
                rows.append({"id": f"{name}@{start}", "text": piece})
            if len(rows) == count:
                return rows
    raise AssertionError("corpus too small")


def _jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _spec(**settings) -> EngineSpec:
    return EngineSpec(factory=FACTORY, settings={"chunk_size": 32, **settings}, threads=1)


# -- sources ---------------------------------------------------------------------------------


def test_sources_folder_jsonl_and_framework_stores(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.md").write_text("second")
    (tmp_path / "docs" / "sub" / "a.txt").write_text("first")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\x00")
    assert read_source(tmp_path / "docs") == [SourceDocument("b.md", "second"), SourceDocument("sub/a.txt", "first")]

    rows = _jsonl(tmp_path / "c.jsonl", [{"id": "x", "text": "one"}, {"body": "two"}])
    with pytest.raises(InvalidInputError, match="line 2|c.jsonl:2"):
        read_source(rows)
    assert read_source(_jsonl(tmp_path / "d.jsonl", [{"body": "two"}]), text_field="body") == [SourceDocument("line 1", "two")]
    with pytest.raises(InvalidInputError, match="no such file"):
        read_source(tmp_path / "missing")

    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_core.documents import Document
    from langchain_core.stores import InMemoryStore
    from llama_index.core.schema import TextNode
    from llama_index.core.storage.docstore import SimpleDocumentStore

    docstore = InMemoryDocstore({"d1": Document(page_content="alpha"), "d2": Document(page_content="beta")})
    assert [d.text for d in read_source(docstore)] == ["alpha", "beta"]
    store = InMemoryStore()
    store.mset([("k1", Document(page_content="gamma"))])
    assert read_source(store) == [SourceDocument("k1", "gamma")]
    llama = SimpleDocumentStore()
    llama.add_documents([TextNode(text="delta", id_="n1")])
    assert read_source(llama) == [SourceDocument("n1", "delta")]
    assert read_source(["x", "y"]) == [SourceDocument("0", "x"), SourceDocument("1", "y")]


# -- one process -----------------------------------------------------------------------------


def test_local_job_reports_failures_and_a_second_run_skips_everything(tmp_path):
    rows = _corpus(40)
    rows.insert(3, {"id": "blank", "text": "   "})
    source = _jsonl(tmp_path / "corpus.jsonl", rows)
    store = tmp_path / "kv"
    seen = []
    report = warm_corpus(source, _spec(disk_cache_dir=str(store)), batch_size=8, on_progress=lambda r: seen.append(r.done))
    assert report.backend == "local" and report.documents == 41
    assert report.computed == 40 and report.skipped == 0
    assert [f.doc_id for f in report.failures] == ["blank"] and "empty" in report.failures[0].error
    assert seen == [8, 16, 24, 32, 40, 41]
    assert report.computed_tokens == report.tokens > 0 and report.bytes_written > 0
    assert report.documents_per_second > 0 and report.tokens_per_second > 0

    again = warm_corpus(source, _spec(disk_cache_dir=str(store)), batch_size=8)
    assert again.computed == 0 and again.skipped == 40 and again.tokens == report.tokens

    engine = tiny_engine(chunk_size=32, show_progress=False, disk_cache_dir=store)
    assert engine.cache_stats().documents == 40


def test_a_job_needs_a_shared_store(tmp_path):
    source = _jsonl(tmp_path / "c.jsonl", _corpus(2))
    with pytest.raises(InvalidInputError, match="shared store"):
        warm_corpus(source, _spec())
    with pytest.raises(InvalidInputError, match="shared store"):
        warm_corpus(source, _spec(disk_cache_dir="auto"))


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvboost-rag"] == "kvboost_rag.cli:main"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvboost_rag.cli", "warm", *args, "--engine-factory", FACTORY, "--chunk-size", "32"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def test_command_line_warms_a_folder_into_a_disk_store(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for row in _corpus(6):
        (folder / f"{row['id'].replace('@', '_')}.txt").write_text(row["text"])
    done = subprocess.run(
        _cli(str(folder), "--disk-cache-dir", str(tmp_path / "kv"), "--threads", "1", "--json"),
        capture_output=True, text=True, env=_env(), timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["computed"] == 6 and report["backend"] == "local" and report["failures"] == []
    assert "progress 6/6 documents" in done.stderr
    bad = subprocess.run(_cli(str(folder)), capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode != 0 and "shared store" in bad.stderr


# -- Ray, over a Redis Cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_available() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip("Ray is not installed: pip install 'kvboost-rag[ray]'")


@pytest.fixture(scope="module")
def cluster():
    from kvboost_rag.dev.redis_local import RedisNotAvailableError, start_cluster

    try:
        started = start_cluster(3, persistent=False)
    except RedisNotAvailableError as exc:
        pytest.skip(str(exc))
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.redis
def test_ray_job_killed_midway_resumes_and_every_replica_finds_the_corpus(ray_available, cluster, tmp_path):
    """120 documents on 2 Ray workers into a 3-master cluster: the job is killed after a third
    of them, run again (it skips what is stored), and a fresh engine over another node finds
    every document."""
    rows = _corpus(120)
    source = _jsonl(tmp_path / "corpus.jsonl", rows)
    args = _cli(str(source), "--redis-url", cluster.url, "--set", "disk_cache_dir=null", "--workers", "2",
                "--backend", "ray", "--batch-size", "10", "--threads", "1", "--json")
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                           start_new_session=True)
    done_at_kill = 0
    try:
        deadline = time.monotonic() + 240
        for line in job.stderr:
            if "progress " in line:
                done_at_kill = int(line.split("progress ", 1)[1].split("/", 1)[0])
                if done_at_kill >= 40:
                    break
            assert time.monotonic() < deadline, "no progress from the Ray job"
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job's whole session: driver, Ray and workers
        job.wait(timeout=30)
    assert 40 <= done_at_kill < 120, f"killed at {done_at_kill}"

    resumed = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=300, start_new_session=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads(resumed.stdout)
    assert report["backend"] == "ray" and report["workers"] == 2 and report["failures"] == []
    assert report["computed"] + report["skipped"] == 120
    assert report["skipped"] >= done_at_kill and report["computed"] > 0
    assert report["bytes_written"] > 0 and report["tokens_per_second"] > 0

    replica = tiny_engine(chunk_size=32, show_progress=False, disk_cache_dir=None, redis_url=cluster.nodes[2].url)
    try:
        stats = replica.cache_stats()
        assert stats.documents == 120 and stats.documents_by_tier["redis"] == 120
        texts = [row["text"] for row in rows]
        assert replica.is_document_warm(texts[0]) and replica.is_document_warm(texts[-1])
    finally:
        replica.clear_cache()
