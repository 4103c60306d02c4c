"""Contiguous runs of sorted positions (each run: one stretch of a cached document)."""

from __future__ import annotations

import torch


def contiguous_runs(positions: torch.Tensor) -> list[torch.Tensor]:
    """Split sorted positions into contiguous runs."""
    if positions.numel() == 0:
        return []
    breaks = (positions[1:] != positions[:-1] + 1).nonzero().view(-1) + 1
    return list(torch.tensor_split(positions, breaks.tolist()))
