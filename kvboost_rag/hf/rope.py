"""Finding a model's RoPE frequencies (what re-rotating cached keys needs).

Position-independent reuse relies on keys being rotated by RoPE with fixed frequencies
(rotate-half convention, full or partial rotary): a key computed at position ``p0`` moves to
``p`` by rotating it by ``p - p0``. Models without that property get prefix-only reuse.
"""

from __future__ import annotations

import torch

#: Architectures whose RoPE re-rotation is verified by the test suite.
POSITION_INDEPENDENT_TYPES = frozenset(
    {
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
        "phi3", "stablelm", "granite", "olmo", "olmo2",
    }
)
#: RoPE variants whose frequencies do not depend on sequence length.
FIXED_FREQUENCY_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def find_rope(model: torch.nn.Module, config, layers: int, head_dim: int) -> tuple[torch.Tensor | None, str]:
    """RoPE frequencies of every layer, ``[layers, rotary_dim / 2]`` float64.

    Models with one RoPE for all layers repeat one row; models whose layer types carry their
    own RoPE base (Gemma 3: ``sliding_attention`` / ``full_attention``) get each layer's own
    row, from the rotary module's ``{layer_type}_inv_freq`` buffers.

    Args:
        model: The model.
        config: Its text config.
        layers: Number of decoder layers.
        head_dim: Size of one attention head.

    Returns:
        The frequencies and ``""``, or ``None`` and why keys cannot be re-rotated.
    """
    model_type = getattr(config, "model_type", "?")
    if model_type not in POSITION_INDEPENDENT_TYPES:
        return None, f"model type {model_type!r} has no verified RoPE re-rotation"
    rotary = [module for name, module in model.named_modules() if name.endswith("rotary_emb")]
    if len(rotary) != 1:
        return None, f"expected one rotary embedding, found {len(rotary)}"
    module = rotary[0]
    layer_types = list(getattr(config, "layer_types", None) or [])
    shared = getattr(module, "inv_freq", None)
    if isinstance(shared, torch.Tensor):
        rows = [shared] * layers
        rope_types = [getattr(module, "rope_type", "default")]
    elif len(layer_types) == layers and all(isinstance(getattr(module, f"{t}_inv_freq", None), torch.Tensor) for t in layer_types):
        rows = [getattr(module, f"{t}_inv_freq") for t in layer_types]
        per_type = getattr(module, "rope_type", {})
        rope_types = [per_type.get(t, "default") for t in layer_types] if isinstance(per_type, dict) else [per_type]
    else:
        return None, "the rotary embedding exposes no frequencies for every layer"
    changing = sorted({str(t) for t in rope_types if t not in FIXED_FREQUENCY_ROPE})
    if changing:
        return None, f"RoPE type {changing[0]!r} changes frequencies with length"
    if len({row.shape for row in rows}) != 1:
        return None, "layers rotate different numbers of dimensions"
    inv_freq = torch.stack([row.detach().to("cpu", torch.float64) for row in rows])
    if 2 * inv_freq.shape[1] > head_dim:
        return None, "rotary dimension exceeds head dimension"
    return inv_freq, ""
