"""Setting captured steps up when the engine loads: the mode, the pool, the graphs.

:func:`build_captured_rows` is the one call the engine makes: it decides from the mode and
the device whether captured steps are wanted, plans a slot pool within the byte budget, and
builds every bucket's graph before any request arrives. Whatever fails leaves the eager path
in place and is logged once with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvboost_rag.hf.captured.pool import SlotPool
from kvboost_rag.hf.captured.steps import CapturedMode, CapturedRows, captured_steps_wanted

if TYPE_CHECKING:
    from kvboost_rag.hf.adapter import ModelAdapter

logger = logging.getLogger(__name__)


def build_captured_rows(
    adapter: ModelAdapter,
    mode: CapturedMode,
    pool_bytes: int,
    token_buckets: Sequence[int],
    backend: str | None = "inductor",
) -> CapturedRows | None:
    """Captured steps over a new slot pool, prepared; ``None`` where they are not wanted
    (:func:`~kvboost_rag.hf.captured.steps.captured_steps_wanted`) or cannot be built (the
    reason is logged; decoding stays on the eager path).

    Args:
        adapter: The model adapter.
        mode: ``"auto"``, ``"on"`` or ``"off"`` (the engine's ``captured_steps`` setting).
        pool_bytes: Bytes of the pool's K and V (``captured_pool_bytes``).
        token_buckets: Token buckets of a step (``captured_token_buckets``).
        backend: ``torch.compile`` backend.
    """
    if not captured_steps_wanted(mode, adapter.device):
        return None
    pool = SlotPool.planned(
        adapter.layout, adapter.dtype, adapter.device, pool_bytes, adapter.context_window, max(token_buckets)
    )
    if pool is None:
        logger.warning(
            "captured steps: %d bytes hold no slot of this model's K/V; raise captured_pool_bytes. "
            "Decoding stays on the eager path", pool_bytes,
        )
        return None
    steps = CapturedRows(adapter, pool, token_buckets, backend=backend)
    return steps if steps.prepare() else None
