"""How an accelerator's free memory is shared between the engine's two K/V users.

On CUDA two things hold K/V in device memory besides the model's weights: the captured steps'
slot pool (:class:`~kvboost_rag.hf.captured.SlotPool`, allocated at load: the prompts decoded
through captured steps live there) and the device tier (the hottest stored chunks, filled as
the engine runs). :func:`plan_device_memory` sizes both from the memory free once the model is
loaded, so that with default settings the longest prompt the context window admits gets a
slot wherever the GPU can hold it:

1. a headroom stays free for activations and temporaries (:data:`HEADROOM_SHARE` of the free
   memory, at least :data:`MIN_HEADROOM_BYTES`), and room for the write-back's staged device
   copies (the chunks a finished prompt stores, copied on the device before its slot goes back:
   at most the copier's queue bound);
2. the pool takes what slots from the context window down to 1,024 tokens need (one of each
   power of two, about twice the window's K/V), at most :data:`POOL_SHARE` of what is left;
3. the device tier takes :data:`DEVICE_TIER_SHARE` of the rest.

A number set for either (``captured_pool_bytes``, ``device_cache_bytes``) is taken as it is.
Where the free memory cannot be read (a CPU, a CUDA device without its runtime's answer) the
same function decides: the pool takes ``max_batch_cache_bytes`` (what the running requests'
K/V may hold), the device tier :data:`DEVICE_TIER_FALLBACK_BYTES`. This is the engine's one
rule for device memory: :func:`device_memory_plan` reads the free memory and applies it.
At the Llama-3.1-8B shape (128 KiB of K/V a token, a 131,072-token window) on an 80 GB GPU
(about 62 GB free after the weights) the pool gets about 21 GB: slots of 131,072, 16,384,
8,192, 4,096 and 1,024 tokens, so a prompt of up to the whole window decodes captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from kvboost_rag.config import KVBoostSettings

#: Share of the free memory left to activations and temporaries.
HEADROOM_SHARE = 0.15
#: Least memory left to activations and temporaries.
MIN_HEADROOM_BYTES = 2 * 1024**3
#: Most of the memory past the headroom the captured steps' pool takes by default.
POOL_SHARE = 0.4
#: Share of the memory past the headroom and the pool the device tier takes by default.
DEVICE_TIER_SHARE = 0.5
#: Slots of a pool planned from the context window: one of each capacity halving from the
#: window, about this many windows of K/V in all.
WINDOWS_OF_SLOTS = 2
#: ``device_cache_bytes="auto"`` where the free memory cannot be read.
DEVICE_TIER_FALLBACK_BYTES = 1024**3


@dataclass(frozen=True)
class DeviceMemoryPlan:
    """Bytes of device memory for the captured steps' pool and for the device tier.

    Attributes:
        pool_bytes: K and V of the pool's slots (0: no captured steps).
        device_tier_bytes: Budget of the device tier (0: none).
    """

    pool_bytes: int
    device_tier_bytes: int


def plan_device_memory(
    free_bytes: int | None,
    kv_bytes_per_token: int,
    context_window: int,
    *,
    pool: int | Literal["auto"] | None,
    device_tier: int | Literal["auto"],
    staged_bytes: int = 0,
    batch_bytes: int = 0,
) -> DeviceMemoryPlan:
    """Share ``free_bytes`` of device memory between the pool and the device tier.

    Args:
        free_bytes: Device memory free now (the model loaded); ``None`` where it cannot be
            read.
        kv_bytes_per_token: Bytes of one token's K and V over every layer.
        context_window: Most positions a prompt and its answer take.
        pool: ``captured_pool_bytes``; ``None`` when there are no captured steps.
        device_tier: ``device_cache_bytes``.
        staged_bytes: Most bytes of staged device copies (kept free beside the headroom).
        batch_bytes: ``max_batch_cache_bytes``: an ``"auto"`` pool's size where ``free_bytes``
            is ``None``.

    Returns:
        The plan (see the module docstring).
    """
    if free_bytes is None:
        pool_bytes = 0 if pool is None else batch_bytes if pool == "auto" else int(pool)
        tier_bytes = DEVICE_TIER_FALLBACK_BYTES if device_tier == "auto" else int(device_tier)
        return DeviceMemoryPlan(pool_bytes=pool_bytes, device_tier_bytes=tier_bytes)
    usable = max(0, free_bytes - max(MIN_HEADROOM_BYTES, int(free_bytes * HEADROOM_SHARE)) - staged_bytes)
    if pool is None:
        pool_bytes = 0
    elif pool == "auto":
        wanted = WINDOWS_OF_SLOTS * context_window * kv_bytes_per_token
        pool_bytes = min(wanted, int(usable * POOL_SHARE))
    else:
        pool_bytes = int(pool)
    tier_bytes = int(max(0, usable - pool_bytes) * DEVICE_TIER_SHARE) if device_tier == "auto" else int(device_tier)
    return DeviceMemoryPlan(pool_bytes=pool_bytes, device_tier_bytes=tier_bytes)


def device_memory_plan(
    settings: KVBoostSettings,
    device: torch.device,
    kv_bytes_per_token: int,
    context_window: int,
    *,
    captured: bool,
    staged_bytes: int,
) -> DeviceMemoryPlan:
    """The plan for an engine on ``device``: :func:`plan_device_memory` over the memory free
    now, the settings' ``captured_pool_bytes`` (when ``captured``: the engine builds captured
    steps), ``device_cache_bytes`` (none on a CPU, whose tiers hold no device tier) and
    ``max_batch_cache_bytes``, and ``staged_bytes`` (the
    write-back's staged device copies: at most the copier's queue bound)."""
    return plan_device_memory(
        free_device_memory(device), kv_bytes_per_token, context_window,
        pool=settings.captured_pool_bytes if captured else None,
        device_tier=0 if device.type == "cpu" else settings.device_cache_bytes,  # no device tier on a CPU
        staged_bytes=staged_bytes, batch_bytes=settings.max_batch_cache_bytes,
    )


def free_device_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now, ``None`` where it cannot be read (no CUDA runtime)."""
    if device.type != "cuda":
        return None
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except (RuntimeError, AssertionError, ValueError):
        return None
    return int(free)
