"""Captured steps: decode and draft-verify steps as compiled graphs over a static K/V pool.

- :mod:`~kvboost_rag.hf.captured.pool`: :class:`SlotPool`, the preallocated K/V of the
  sequences decoded this way, cut into slots of a few capacities.
- :mod:`~kvboost_rag.hf.captured.rows`: :class:`Row` (one sequence's part of a step), the
  host table a step copies to the device, :class:`StepLogits`.
- :mod:`~kvboost_rag.hf.captured.attention`: the pool as a transformers cache and the one
  attention call per layer that reads each row's own slot.
- :mod:`~kvboost_rag.hf.captured.graph`: one token bucket's compiled function and CUDA graph.
- :mod:`~kvboost_rag.hf.captured.steps`: :class:`CapturedRows` (``prepare``, ``run``).
- :mod:`~kvboost_rag.hf.captured.build`: :func:`build_captured_rows` and
  :func:`build_prefill_rows`, what the engine calls at load.

How the engine uses them::

    # at load (settings: captured_steps, captured_pool_bytes, captured_token_buckets)
    steps = build_captured_rows(adapter, mode, pool_bytes, token_buckets)  # None: all eager
    # a prompt: a slot for its prompt and every token it may decode (else the eager path)
    slot = steps.pool.acquire(prompt_tokens + reserve)
    keys, values = steps.pool.buffers(slot)  # [layers, kv_heads, capacity, head_dim] views
    cache = adapter.cache_over(keys, values, length)  # stitch, probe, blend, lookahead as today
    # each decode (or draft-verify) step, holding the model
    logits = steps.run([Row(slot, [token], length), Row(other, [pending, *drafts], other_length)])
    logits.last(0)  # [vocab]; logits.row(1): [1 + drafts, vocab]; valid until the next step
    length += 1     # the caller's count: keep as many tokens as it accepts, nothing to undo
    # prefill passes in one step (captured_prefill_buckets): the pool's scratch rows hold
    # their largest bucket; the tokens after a prefix hit of h tokens, or a blend pass
    passes = build_prefill_rows(steps, prefill_buckets)  # last logits only; None: eager
    passes.run([Row(slot, prompt_ids[h:], h)]).last(0)
    probe = build_prefill_rows(steps, probe_buckets(prefill_buckets), record_queries=1)
    probe.run([Row(slot, live_tokens, positions=live_positions)])  # the repair's probe
    probe.recorded(slot, prompt_tokens)  # [prompt_tokens] attention per layer, as run_probe's
    passes.run([Row(slot, chosen_tokens, positions=chosen_positions)]).last(0)
    steps.pool.release(slot)

A cache built over a slot keeps the length it was built with: before an eager pass on a
sequence that captured steps moved on, build a new one with its current length.
"""

from kvboost_rag.hf.captured.build import build_captured_rows, build_prefill_rows, probe_buckets
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
    "build_prefill_rows",
    "probe_buckets",
    "captured_steps_wanted",
    "plan_capacities",
]
