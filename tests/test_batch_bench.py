"""The batch benchmark runs end to end on a tiny random model and checks what it measures."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import batch_bench  # noqa: E402


def test_tiny_run_measures_every_part(tmp_path, capsys):
    steps, batch, rows, load = batch_bench.main(
        ["--model", "tiny", "--prompts", "3", "--new-tokens", "6", "--requests", "3", "--concurrency", "1,3",
         "--arrivals", "3", "--rate", "50", "--load-new-tokens", "4", "--doc-chars", "300", "--out", str(tmp_path)]
    )
    assert [step.batch for step in steps] == [1, 3] and all(step.step_ms > 0 for step in steps)
    assert batch.prompts == 3 and batch.identical == 3
    assert batch.sequential_s > 0 and batch.batch_s > 0
    systems = {r.system for r in rows}
    assert len(systems) == 4 and {r.concurrency for r in rows} == {1, 3}
    for row in rows:
        assert row.requests == 3 and row.tokens > 0 and math.isfinite(row.tokens_per_s)
    kvboost_rows = [r for r in rows if not r.system.startswith("HuggingFacePipeline")]
    assert all(r.tokens == 3 * 4 for r in kvboost_rows), "every request generated its 4 tokens"
    assert [row.mode for row in load] == ["continuous batching", "one at a time"]
    assert all(len(row.ttft_ms) == 3 and row.percentile(0.5) <= row.percentile(0.95) for row in load)
    out = capsys.readouterr().out
    assert "| sequences per decode step |" in out and "| 3 x 6 |" in out and "3/3 |" in out and "| engine (threads) |" in out
    assert (tmp_path / "batch_throughput.png").stat().st_size > 0


def test_percentile_is_nearest_rank():
    row = batch_bench.LoadRow("m", 1.0, [float(v) for v in range(1, 21)], 1.0)
    assert row.percentile(0.5) == 10.0 and row.percentile(0.95) == 19.0 and row.percentile(1.0) == 20.0
