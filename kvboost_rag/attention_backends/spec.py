"""What every attention call of a layer shares, as one value the passes hand down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """A layer's attention: its softmax scale, sliding window and logit softcap.

    Attributes:
        scale: Softmax scale of the scores.
        window: Keys a query sees, its own included (a sliding-window layer), or ``None``
            (every key up to its position).
        softcap: Scores pass through ``tanh(score / softcap) * softcap``, or ``None``.
    """

    scale: float
    window: int | None = None
    softcap: float | None = None

    @classmethod
    def of_call(cls, query: torch.Tensor, scaling: float | None, options: Mapping[str, Any]) -> AttentionSpec:
        """The spec of a call of an attention function registered with transformers: its
        ``scaling`` (default ``dim ** -0.5``) and its keyword options ``sliding_window`` and
        ``softcap`` (``0`` or ``None``: none)."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cls(scale, options.get("sliding_window") or None, options.get("softcap") or None)
