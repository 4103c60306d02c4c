"""The shape benchmark runs end to end on a tiny shape on CPU and checks what it measures."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_bench  # noqa: E402


@pytest.mark.parametrize(("attention", "shown"), [("auto", "blocks"), ("masked_sdpa", "masked_sdpa")])
def test_tiny_shape_runs_every_row_in_bfloat16(capsys, attention, shown):
    rows = gpu_bench.main(
        ["--shape", "tiny", "--tokenizer", "tiny", "--device", "cpu", "--dtype", "bfloat16", "--lengths", "300",
         "--repeats", "1", "--decode-tokens", "6", "--chunk-size", "32", "--attention", attention]
    )
    assert len(rows) == 1
    row = rows[0]
    assert 250 <= row.prompt_tokens <= 300
    assert 0 < row.recompute_ratio <= 0.2
    for value in (row.full_ms, row.prefix_ms, row.blend_ms, row.engine_tps, row.generate_tps):
        assert math.isfinite(value) and value > 0
    assert 0 < row.tokenize_ms < row.prefix_ms
    assert row.prefix_overhead_ms <= row.prefix_ms and row.blend_overhead_ms <= row.blend_ms
    table = capsys.readouterr().out
    assert "shape=tiny layers=2 dtype=bfloat16 device=cpu" in table and f"attention={shown};" in table
    assert f"| {row.prompt_tokens} |" in table


@pytest.mark.parametrize("shape", ["Llama-3.1-8B", "Qwen2.5-7B", "Mistral-7B"])
def test_named_shapes_build_with_published_dimensions(shape):
    model = gpu_bench.build_model(shape, layers=1, device=torch.device("meta"), dtype=torch.bfloat16)
    model_type, fields = gpu_bench.SHAPES[shape]
    config = model.config
    assert config.model_type == model_type and config.num_hidden_layers == 1
    assert (config.hidden_size, config.num_key_value_heads, config.vocab_size) == (
        fields["hidden_size"], fields["num_key_value_heads"], fields["vocab_size"]
    )
    assert next(model.parameters()).dtype == torch.bfloat16


def test_prompt_has_about_the_requested_length():
    from kvboost_rag.dev.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    prompt, documents, shuffled = gpu_bench.build_prompt(tokenizer, 1000, seed=1)
    n = len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert 900 <= n <= 1000 and len(documents) >= 2
    assert shuffled != prompt and sorted(shuffled) == sorted(prompt)  # same text, documents reordered
    assert len(tokenizer(shuffled, add_special_tokens=False).input_ids) == pytest.approx(n, abs=8)


def test_tokenizer_from_a_folder(tmp_path):
    """A folder holding only a tokenizer's files (what ``scripts/gpu_wheels.sh`` carries to a
    GPU machine that lacks the embedded model) loads as the tokenizer saved there."""
    from kvboost_rag.dev.testing import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()
    text = "def f(x):\n    return x + 1"
    assert gpu_bench.load_tokenizer(str(tmp_path))(text).input_ids == tiny_tokenizer()(text).input_ids
