"""The attention repair's probe: layers it runs, queries it reads, scores it returns."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvboost_rag import KVBoostSettings
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.repair.probe import attention_scores, run_probe


@pytest.fixture(scope="module")
def adapter(tokenizer):
    return ModelAdapter(tiny_model("llama"), tokenizer)


def stitched(adapter: ModelAdapter, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V buffers of ``n`` tokens computed by a plain forward pass (a stand-in stitched cache)."""
    keys, values = adapter.buffers(n)
    cache = adapter.cache_over(keys, values, 0)
    adapter.forward(torch.arange(n) % 50 + 5, torch.arange(n), cache)
    return keys, values


@pytest.mark.parametrize("layers", [None, 1, 2, 99])
def test_probe_records_one_attention_per_layer_it_runs(adapter, layers):
    n = 40
    keys, values = stitched(adapter, n)
    positions = torch.tensor([30, 31, 38, 39])
    recorded = run_probe(adapter, torch.tensor([7, 8, 9, 10]), positions, keys, values, n, layers=layers, queries=2)
    expected = adapter.num_layers if layers is None else min(layers, adapter.num_layers)
    assert len(recorded) == expected
    for weights in recorded:
        assert weights.shape == (n,)
        assert weights.sum().item() == pytest.approx(2.0, abs=1e-4)  # two queries' softmax rows
        assert weights[40:].numel() == 0 and weights[:39].sum() > 0


def test_partial_probe_attention_equals_the_full_probes_first_layers(adapter):
    n = 40
    positions = torch.tensor([35, 36, 37, 38, 39])
    ids = torch.tensor([11, 12, 13, 14, 15])
    keys, values = stitched(adapter, n)
    full = run_probe(adapter, ids, positions, keys.clone(), values.clone(), n)
    part = run_probe(adapter, ids, positions, keys.clone(), values.clone(), n, layers=2)
    for a, b in zip(part, full[:2]):
        assert torch.allclose(a, b, atol=1e-6)


def test_scores_sum_layers_and_weight_by_value_norms():
    recorded = [torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1])]
    positions = torch.tensor([1, 3])
    assert torch.allclose(attention_scores(recorded, positions), torch.tensor([0.5, 0.5]))
    values = torch.ones(2, 1, 4, 2)
    values[:, :, 3] *= 3.0  # token 3's values are 3x token 1's in both layers
    weighted = attention_scores(recorded, positions, values)
    # weights relative to the mean norm over the scored tokens: 0.5 and 1.5
    assert torch.allclose(weighted, torch.tensor([0.2 * 0.5 + 0.3 * 0.5, 0.4 * 1.5 + 0.1 * 1.5]))


def test_probe_settings_are_validated():
    assert KVBoostSettings().probe_layers is None and KVBoostSettings().probe_queries == 1
    with pytest.raises(ValidationError, match="probe_queries"):
        KVBoostSettings(probe_queries=0)
    with pytest.raises(ValidationError, match="probe_layers"):
        KVBoostSettings(probe_layers=0)


def test_depth_weighting_ignores_the_first_layer():
    recorded = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5])]
    scores = attention_scores(recorded, torch.tensor([0, 1]), depth_weighted=True)
    assert torch.allclose(scores, torch.tensor([0.0 * 1 + 1.0 * 0 + 0.5 * 2, 0.0 + 1.0 + 0.5 * 2]))
