"""Every example script runs as is on the embedded model (small settings to stay quick), each in
a process of its own (forked from one that imported the shared dependencies once)."""

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from forked_scripts import ForkedScripts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_example() -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """``run_example(name, *args, timeout=600)``: ``examples/name`` run with ``args``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    scripts = ForkedScripts(env)

    def run(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
        return scripts.run(ROOT / "examples" / name, list(args), cwd=ROOT, timeout=timeout)

    yield run
    scripts.close()


def test_quickstart(run_example):
    out = run_example("quickstart.py", "--doc-chars", "300", "--max-new-tokens", "6")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TTFT with reuse" in out.stdout
    reused = [line for line in out.stdout.splitlines() if line.startswith("reused")]
    assert reused and "document tokens (re-rotated)" in reused[0]
    assert not reused[0].startswith("reused 0%")


def test_verify_correctness_passes_at_full_recompute(run_example):
    out = run_example(
        "verify_correctness.py", "--prompts", "2", "--docs-per-prompt", "2", "--max-new-tokens", "4", "--recompute-ratio", "1.0"
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "PASSED" in out.stdout
    assert out.stdout.count("| yes | yes |") == 2


def test_prewarm_store_serves_a_fresh_process_from_disk(run_example, tmp_path):
    out = run_example(
        "prewarm_store.py", "--docs", "3", "--top-k", "2", "--new-tokens", "4", "--store-dir", str(tmp_path / "store")
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert any(tmp_path.joinpath("store").iterdir())
    assert "corpus registered" in out.stdout and "(0 tokens computed)" in out.stdout  # read, not recomputed


def test_langchain_rag_example(run_example):
    out = run_example(
        "langchain_rag.py", "--question", "What does the assert statement do?", "--k", "2", "--max-chars", "300",
        "--max-new-tokens", "6", "--docs", "16",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ms" in out.stdout


def test_llamaindex_query_engine_example(run_example):
    out = run_example(
        "llamaindex_query_engine.py", "--question", "What does the assert statement do?", "--top-k", "2", "--max-chars", "300",
        "--max-new-tokens", "6", "--docs", "16",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ms" in out.stdout


def test_side_by_side_example_prints_both_frameworks_against_their_baselines(run_example):
    out = run_example("side_by_side.py", "--docs", "10", "--max-chars", "300", "--k", "2", "--questions", "1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| L")]
    assert [r.split(" | ")[1] for r in rows] == ["ChatHuggingFace", "HuggingFaceLLM", "HuggingFaceLLM"]
    assert all(int(r.split(" | ")[5].rstrip("%")) >= 80 for r in rows), rows  # document tokens from cache
    assert all(float(r.split(" | ")[6]) < 1.0 for r in rows), rows  # MiB: no growth per query
    assert all(r.split(" | ")[7].rstrip(" |") in ("0/1", "1/1") for r in rows), rows  # same answers


def test_agentic_rag_example_calls_the_retriever_and_reuses_its_documents(run_example):
    out = run_example(
        "agentic_rag.py", "--question", "What does the pass statement do?", "--docs", "12", "--k", "2",
        "--max-chars", "200", "--max-new-tokens", "32", "--max-steps", "2",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    steps = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| 1 | ")]
    assert steps[0][2] == "any" and steps[0][6].startswith("call search_python_docs(")
    assert steps[1][2] == "none" and not steps[1][6].startswith("call ")
    assert int(steps[1][5]) > int(steps[0][5])  # the answer step reads the retrieved documents from cache
    assert "ChatHuggingFace made" in out.stdout
    assert "Median answer-step TTFT speedup" in out.stdout
