"""Setting captured steps up when the engine loads: the mode, the pool, the graphs.

:func:`build_captured_rows` is the one call the engine makes: it decides from the mode and
the device whether captured steps are wanted, plans a slot pool within the byte budget, and
builds every bucket's graph before any request needs it (on a thread of its own with
``background``). Whatever fails leaves the eager path in place and is logged once with its
reason. Every captured step of an engine shares one CUDA graph memory pool.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvboost_rag.hf.captured.pool import SlotPool
from kvboost_rag.hf.captured.steps import CapturedMode, CapturedRows, captured_steps_wanted
from kvboost_rag.decode_weights.small_rows import DecodeWeights, decode_reads

if TYPE_CHECKING:
    from kvboost_rag.hf.adapter import ModelAdapter

logger = logging.getLogger(__name__)


def build_captured_rows(
    adapter: ModelAdapter,
    mode: CapturedMode,
    pool_bytes: int,
    token_buckets: Sequence[int],
    backend: str | None = "inductor",
    scratch_tokens: int | None = None,
    background: bool = False,
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
        scratch_tokens: Scratch rows of the pool (padded tokens of the largest step that will
            run on it: :func:`build_prefill_rows`' buckets too); default: the largest token
            bucket.
        background: Build the buckets on a thread of their own (see
            :meth:`~kvboost_rag.hf.captured.steps.CapturedRows.prepare`); the pool hands out
            slots once the first is ready.
    """
    if not captured_steps_wanted(mode, adapter.device):
        return None
    pool = SlotPool.planned(
        adapter.layout, adapter.dtype, adapter.device, pool_bytes, adapter.context_window,
        scratch_tokens or max(token_buckets), opened=not background,
    )
    if pool is None:
        logger.warning(
            "captured steps: %d bytes hold no slot of this model's K/V; raise captured_pool_bytes. "
            "Decoding stays on the eager path", pool_bytes,
        )
        return None
    steps = CapturedRows(adapter, pool, token_buckets, backend=backend)
    return steps if steps.prepare(background) else None


def unread_decode_copies(adapter: ModelAdapter, decode_weights: DecodeWeights) -> str | None:
    """Why ``decode_weights`` goes unread with captured steps, where it would not be on the
    eager path: on a CPU, the int8 copy or the 4-bit runs eager decode steps would read
    (captured steps read the model's own weights); ``None`` where nothing is lost."""
    if adapter.device.type != "cpu":
        return None
    if decode_weights != "stored" and decode_reads(adapter.model, decode_weights) != "int8":
        return None
    return (
        f"captured steps read the model's own weights: decode_weights={decode_weights!r} is not used (eager "
        "steps would read its int8 copies or 4-bit runs). Where measured (Qwen2.5-0.5B's int8 default, "
        "docs/benchmarks.md) eager int8 steps decoded faster than captured ones; captured_steps='off' keeps them"
    )


#: Largest token bucket of the probe's passes (its live tokens: the question, separators, the
#: last token): a probe reads only the smallest prefill buckets.
MAX_PROBE_TOKENS = 512


def probe_buckets(prefill_buckets: Sequence[int]) -> tuple[int, ...]:
    """The prefill buckets the probe's passes are built for: those up to
    :data:`MAX_PROBE_TOKENS`, or the smallest when none is."""
    if not prefill_buckets:
        return ()
    return tuple(b for b in prefill_buckets if b <= MAX_PROBE_TOKENS) or (min(prefill_buckets),)


def build_prefill_rows(
    rows: CapturedRows | None,
    token_buckets: Sequence[int],
    record_queries: int = 0,
    background: bool = False,
    after: CapturedRows | None = None,
) -> CapturedRows | None:
    """Captured prefill passes (one row, the logits of its last token: the tokens after an
    exact prefix hit, the attention repair's probe, a blend pass) over the pool of the decode
    steps ``rows``, built with their backend and prepared; ``None`` without decode steps or
    buckets, or where they cannot be built (the reason is logged; prefill stays eager).

    Args:
        rows: The engine's captured decode steps (:func:`build_captured_rows`).
        token_buckets: Token buckets of a prefill pass (``captured_prefill_buckets``); the
            pool's scratch region must hold the largest.
        record_queries: Every pass also records the attention of its last this many tokens
            over the whole pool, in every layer (``probe_queries``: the attention repair's
            probe, built apart with :func:`probe_buckets`); 0: none.
        background: Build them on a thread of their own (each used once ready), once
            ``after`` (default: ``rows``) is built.
        after: Captured steps built before these in the background.
    """
    if rows is None or not token_buckets:
        return None
    steps = CapturedRows(
        rows.adapter, rows.pool, token_buckets, backend=rows.backend, last_logits=True, record_queries=record_queries,
        memory_pool=rows.memory_pool,
    )
    return steps if steps.prepare(background, after=after or rows) else None
