"""Device memory shared between the captured steps' pool and the device tier
(:func:`~kvboost_rag.cache.device_memory.plan_device_memory`, a pure function): with default
settings the longest prompt a GPU can hold gets a slot, numbers set by hand are kept, and the
two never take the headroom left to activations."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.cache.device_memory import (
    DEVICE_TIER_FALLBACK_BYTES,
    MIN_HEADROOM_BYTES,
    DeviceMemoryPlan,
    device_memory_plan,
    plan_device_memory,
)
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.cache.codec import KVLayout
from kvboost_rag.hf.captured.pool import SlotPool, plan_capacities, round_to_block

GiB = 1024**3
#: Llama-3.1-8B: 32 layers, 8 KV heads of 128, bfloat16: 128 KiB of K/V a token.
LLAMA_8B = KVLayout(32, 8, 128)
PER_TOKEN_8B = 2 * 32 * 8 * 128 * 2
WINDOW_8B = 131072
SCRATCH = 16


def _largest_slot(pool_bytes: int, per_token: int, window: int) -> int:
    """What :meth:`SlotPool.planned` would give as its largest slot (0: no slot)."""
    capacities = plan_capacities(pool_bytes // per_token - round_to_block(SCRATCH), window)
    return max(capacities, default=0)


@pytest.mark.parametrize(("free_gb", "longest"), [(62, WINDOW_8B), (120, WINDOW_8B), (24, 32768)])
def test_the_longest_prompt_the_gpu_can_hold_gets_a_slot_with_defaults(free_gb, longest):
    """8B shape: an 80 GB GPU (62 GB free after the weights) and a 141 GB one give the whole
    context window a slot, so a 32k-token prompt and its answer decode captured; a 40 GB GPU
    (24 GB free) gives a prompt and its answer of up to 32,768 tokens one."""
    free = free_gb * 10**9
    plan = plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier="auto")
    assert _largest_slot(plan.pool_bytes, PER_TOKEN_8B, WINDOW_8B) >= longest
    assert plan.device_tier_bytes > 0
    assert plan.pool_bytes + plan.device_tier_bytes <= free - MIN_HEADROOM_BYTES


def test_numbers_set_by_hand_are_kept_and_no_captured_steps_take_no_pool():
    free = 62 * 10**9
    plan = plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool=3 * GiB, device_tier=5 * GiB)
    assert (plan.pool_bytes, plan.device_tier_bytes) == (3 * GiB, 5 * GiB)
    plan = plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool=None, device_tier="auto")
    with_pool = plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier="auto")
    assert plan.pool_bytes == 0 and plan.device_tier_bytes > with_pool.device_tier_bytes
    assert plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier=0).device_tier_bytes == 0


def test_a_small_model_gets_slots_for_its_whole_window_and_no_more():
    """A small model's pool is what slots from its window down need, not a share of the GPU."""
    per_token, window = 2 * 24 * 2 * 64 * 2, 32768  # a 0.5B model in bfloat16
    plan = plan_device_memory(70 * 10**9, per_token, window, pool="auto", device_tier="auto")
    assert plan.pool_bytes == 2 * window * per_token
    assert _largest_slot(plan.pool_bytes, per_token, window) == window


def test_too_little_free_memory_leaves_no_slot_and_no_tier():
    plan = plan_device_memory(MIN_HEADROOM_BYTES // 2, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier="auto")
    assert plan.pool_bytes == 0 and plan.device_tier_bytes == 0
    assert SlotPool.planned(LLAMA_8B, torch.bfloat16, "meta", plan.pool_bytes, WINDOW_8B, SCRATCH) is None


def test_room_for_the_write_backs_staged_device_copies_is_kept_beside_the_headroom():
    """The chunks a finished prompt stores are copied on the device before its slot goes back:
    up to the copier's queue bound of them is left out of the pool and the device tier."""
    free, staged = 62 * 10**9, 2 * GiB
    plain = plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier="auto")
    kept = plan_device_memory(free, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier="auto", staged_bytes=staged)
    assert kept.pool_bytes + kept.device_tier_bytes <= free - MIN_HEADROOM_BYTES - staged
    assert kept.pool_bytes + kept.device_tier_bytes < plain.pool_bytes + plain.device_tier_bytes


def test_where_free_memory_cannot_be_read_the_same_rule_sizes_both():
    """A CPU (or a CUDA device whose runtime does not answer): an ``"auto"`` pool takes
    ``max_batch_cache_bytes``, an ``"auto"`` device tier the fallback; numbers are kept."""
    auto = plan_device_memory(None, PER_TOKEN_8B, WINDOW_8B, pool="auto", device_tier="auto", batch_bytes=3 * GiB)
    assert auto == DeviceMemoryPlan(pool_bytes=3 * GiB, device_tier_bytes=DEVICE_TIER_FALLBACK_BYTES)
    assert plan_device_memory(None, PER_TOKEN_8B, WINDOW_8B, pool=None, device_tier=5) == DeviceMemoryPlan(0, 5)
    assert plan_device_memory(None, PER_TOKEN_8B, WINDOW_8B, pool=7, device_tier=0).pool_bytes == 7
    settings = KVBoostSettings(max_batch_cache_bytes=2 * GiB)
    on_cpu = device_memory_plan(settings, torch.device("cpu"), PER_TOKEN_8B, WINDOW_8B, captured=True, staged_bytes=GiB)
    assert on_cpu.pool_bytes == 2 * GiB and on_cpu.device_tier_bytes == 0  # a CPU has no device tier
    eager = device_memory_plan(settings, torch.device("cpu"), PER_TOKEN_8B, WINDOW_8B, captured=False, staged_bytes=GiB)
    assert eager.pool_bytes == 0
