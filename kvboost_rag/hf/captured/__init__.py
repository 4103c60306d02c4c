"""Captured steps: decode and draft-verify steps as compiled graphs over a static K/V pool.

- :mod:`~kvboost_rag.hf.captured.pool`: :class:`SlotPool`, the preallocated K/V of the
  sequences decoded this way, cut into slots of a few capacities.
- :mod:`~kvboost_rag.hf.captured.rows`: :class:`Row` (one sequence's part of a step), the
  host table a step copies to the device, :class:`StepLogits`.
- :mod:`~kvboost_rag.hf.captured.attention`: the pool as a transformers cache and the one
  attention call per layer that reads each row's own slot.
- :mod:`~kvboost_rag.hf.captured.graph`: one token bucket's compiled function and CUDA graph.
- :mod:`~kvboost_rag.hf.captured.steps`: :class:`CapturedRows` (``prepare``, ``run``).
- :mod:`~kvboost_rag.hf.captured.build`: :func:`build_captured_rows`, what the engine calls
  at load.
"""

from kvboost_rag.hf.captured.build import build_captured_rows
from kvboost_rag.hf.captured.pool import KV_BLOCK, Slot, SlotPool, plan_capacities
from kvboost_rag.hf.captured.rows import Row, StepLogits
from kvboost_rag.hf.captured.steps import (
    DEFAULT_TOKEN_BUCKETS,
    CapturedMode,
    CapturedRows,
    captured_steps_wanted,
)

__all__ = [
    "DEFAULT_TOKEN_BUCKETS",
    "KV_BLOCK",
    "CapturedMode",
    "CapturedRows",
    "Row",
    "Slot",
    "SlotPool",
    "StepLogits",
    "build_captured_rows",
    "captured_steps_wanted",
    "plan_capacities",
]
