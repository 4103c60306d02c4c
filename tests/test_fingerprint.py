"""Model fingerprints: any change to any weight, buffer or adapter gives another fingerprint."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.hf import ModelAdapter


class _LoraLinear(torch.nn.Module):
    """The peft layout of an unmerged LoRA: the original Linear plus two low-rank factors."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_A.weight, std=0.02)
        torch.nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def _fingerprint(model: torch.nn.Module, tokenizer) -> str:
    return ModelAdapter(model, tokenizer).fingerprint(["bits=None"])


def test_same_model_twice_gives_the_same_fingerprint(tokenizer):
    assert _fingerprint(tiny_model(), tokenizer) == _fingerprint(tiny_model(), tokenizer)


def test_extra_settings_change_the_fingerprint(tokenizer):
    adapter = ModelAdapter(tiny_model(), tokenizer)
    assert adapter.fingerprint(["bits=None"]) != adapter.fingerprint(["bits=8"])


@pytest.mark.parametrize("where", ["last_layer_mlp_end", "middle_layer_v_proj", "final_norm"])
def test_a_small_change_to_a_deep_weight_changes_the_fingerprint(tokenizer, where):
    base = _fingerprint(tiny_model(), tokenizer)
    model = tiny_model()
    layers = model.model.layers
    param = {
        "last_layer_mlp_end": layers[-1].mlp.down_proj.weight,
        "middle_layer_v_proj": layers[1].self_attn.v_proj.weight,
        "final_norm": model.model.norm.weight,
    }[where]
    with torch.no_grad():
        param.view(-1)[-1] += 1e-3  # the very last element: past any leading sample
    assert _fingerprint(model, tokenizer) != base


def test_an_unmerged_lora_adapter_changes_the_fingerprint(tokenizer):
    base = _fingerprint(tiny_model(), tokenizer)
    model = tiny_model()
    attention = model.model.layers[-1].self_attn
    torch.manual_seed(1)
    attention.v_proj = _LoraLinear(attention.v_proj)
    assert _fingerprint(model, tokenizer) != base


def test_a_changed_buffer_changes_the_fingerprint(tokenizer):
    base = _fingerprint(tiny_model(), tokenizer)
    model = tiny_model()
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq * 1.001  # a different RoPE base, same config
    assert _fingerprint(model, tokenizer) != base


def test_weights_digest_is_independent_of_storage_layout():
    from kvboost_rag.hf.fingerprint import weights_digest

    model = tiny_model()
    other = tiny_model()
    with torch.no_grad():  # same values, non-contiguous storage
        w = other.model.layers[0].mlp.up_proj.weight
        other.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(w.t().contiguous().t())
    assert weights_digest(model) == weights_digest(other)
