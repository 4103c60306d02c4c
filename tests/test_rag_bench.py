"""The RAG benchmark's core on a tiny random model: every system runs, tables and plots are written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import rag_bench  # noqa: E402
from rag_systems import PrefixCacheGenerate, TransformersGenerate  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """A 3-layer llama with random weights and the tiny trained tokenizer."""
    return tiny_model("llama"), tiny_tokenizer()


def test_exact_match_normalizes_quotes_case_and_spaces():
    assert rag_bench.exact_match('It raises "AssertionError".', ["AssertionError"])
    assert rag_bench.exact_match("floor division by pow(2, n)", ["pow(2,n)"])
    assert not rag_bench.exact_match("It raises TypeError", ["AssertionError"])


def test_qa_answers_are_in_their_documents():
    docs = rag_bench.cut_documents(1200)
    items = rag_bench.load_qa()
    assert 12 <= len(items) <= 20
    assert rag_bench.usable_items(items, docs) == items
    for item in items:
        assert not any(rag_bench.normalize(a) in rag_bench.normalize(item.question) for a in item.answers)


def test_prefix_cache_is_exact(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    docs = list(rag_bench.cut_documents(300).values())[:3]
    head = "Answer from the documents.\n\n"
    prompt = head + "\n\n".join(docs) + "\n\nQuestion: what?"
    full = TransformersGenerate(model, tokenizer).run(prompt, 6)
    cached = PrefixCacheGenerate(model, tokenizer)
    cached.warm(head, docs)
    hit = cached.run(prompt, 6)
    assert hit.reuse > 0.3
    assert hit.token_ids == full.token_ids
    torch.testing.assert_close(hit.first_logits, full.first_logits, rtol=1e-4, atol=1e-4)
    again = cached.run(prompt + " And?", 6)  # the stored prompt + answer is now a prefix
    assert again.reuse > hit.reuse


def test_benchmark_writes_table_and_plots(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    config = rag_bench.BenchConfig(
        questions=2,
        k_values=(2, 3),
        doc_chars=400,
        pool=5,
        qa_questions=2,
        qa_k=2,
        qa_doc_chars=400,
        chat_turns=2,
        new_tokens=4,
        ratios=(0.15,),
        out=tmp_path,
    )
    result = rag_bench.run_benchmark(model, tokenizer, config, show_progress=False)
    result.command = "pytest"
    paths = rag_bench.write_outputs(result, tmp_path)

    names = {r.system for r in result.records}
    assert rag_bench.REFERENCE in names
    assert {"kvboost-rag none", "kvboost-rag selective 15%", "kvboost-rag cacheblend 15%", "kvboost-rag attention 15%"} <= names
    assert any(r.family == "adapter" for r in result.records) or any("unavailable" in n for n in result.notes)
    assert {r.workload for r in result.records} == {"rag", "qa", "chat"}
    ref = [r for r in result.records if r.system == rag_bench.REFERENCE]
    assert all(r.kl == 0.0 and r.greedy == 1.0 for r in ref)
    assert all(r.ttft_ms > 0 for r in result.records)

    report = (tmp_path / "results.md").read_text()
    assert "| kvboost-rag cacheblend 15% |" in report and "Machine:" in report and "Exact-match QA" in report
    for name in (
        "results.md",
        "results.json",
        "ttft_vs_prompt_length.png",
        "quality_vs_recompute_ratio.png",
        "speed_quality_frontier.png",
    ):
        assert (tmp_path / name) in paths
        assert (tmp_path / name).stat().st_size > 0

    again = tmp_path / "again"
    rag_bench.main(["--from-json", str(tmp_path / "results.json"), "--out", str(again)])
    assert (again / "results.md").read_text() == report
    assert (again / "speed_quality_frontier.png").stat().st_size > 0
