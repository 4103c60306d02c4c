"""Decode speed of captured steps against the eager step and ``model.generate`` (gpu_bench.py).

A one-slot pool holds the longest prompt; its step (:class:`kvboost_rag.hf.captured.CapturedRows`,
one token bucket) is built once, timed apart (compile and, on CUDA, graph capture). Each prompt
is prefilled (eagerly) into the slot, then greedy-decoded with captured steps; for comparison
one eager decode step (what the engine's decode worker runs today) is counted. For each: tokens/s of
the greedy loop (the host reads each token, as ``generate`` does), host time to issue one step
(no wait for the device), launches per step (kernel and graph launches, as the profiler sees
them; CUDA only) and whether the greedy tokens equal ``model.generate``'s.

:func:`engine_decode` measures the engine's own ``generate`` on an engine built with captured
steps (every bucket built at load, drafting on): what a user's call gets. Where greedy tokens
part from ``model.generate``'s, :func:`split_margin` gives ``generate``'s margin there (its top
logit less its second): near zero, two candidates tie within bfloat16 rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvboost_rag.dev.op_counts import profile_counts
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.captured import CapturedRows, Row, SlotPool
from kvboost_rag.hf.captured.graph import compile_cache_counts
from kvboost_rag.hf.packed import Segment
from kvboost_rag.dev.internals import internals


@dataclass
class CapturedDecode:
    """One prompt's captured decode figures.

    Attributes:
        tokens_per_s: Greedy decode rate of the captured loop.
        step_host_ms: Host time to issue one captured step (median).
        eager_step_host_ms: Host time to issue one eager decode step (a packed pass of one
            row, what the engine loop runs).
        launches: Kernel and graph launches of one captured step (CUDA only).
        eager_launches: Kernel launches of one eager decode step (CUDA only).
        tokens: The greedy tokens the captured loop produced.
    """

    tokens_per_s: float
    step_host_ms: float
    eager_step_host_ms: float
    launches: int
    eager_launches: int
    tokens: list[int]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eager_step(adapter: ModelAdapter, pool: SlotPool, row: Row) -> tuple[float, int]:
    """Host ms and launches of one eager decode step on the slot (its K/V row is written at
    the position the captured loop overwrites next)."""
    keys, values = pool.buffers(row.slot)
    segment = lambda: Segment(  # noqa: E731
        torch.tensor(row.tokens), torch.tensor([row.position]), adapter.cache_over(keys, values, row.position), logits=1,
        decode=True,
    )
    step = lambda: adapter.forward_segments([segment()])  # noqa: E731
    step()
    _sync(adapter.device)
    start = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - start) * 1000
    return host_ms, profile_counts(step).launches


class CapturedLoop:
    """A greedy decode loop of captured steps over a one-slot pool, built once for every
    prompt of up to ``capacity`` tokens (prompt and decoded tokens).

    Args:
        adapter: The engine's model adapter.
        capacity: Tokens of the slot.

    Attributes:
        prepare_s: Seconds to build the step (compile, and on CUDA capture).
        cache_hits: Compiled graphs found in torch's on-disk cache while preparing.
        cache_misses: Graphs compiled while preparing.
    """

    def __init__(self, adapter: ModelAdapter, capacity: int) -> None:
        self.adapter = adapter
        self.pool = SlotPool(adapter.layout, [capacity], adapter.dtype, adapter.device, scratch_tokens=1)
        self.steps = CapturedRows(adapter, self.pool, (1,))
        hits, misses = compile_cache_counts()
        started = time.perf_counter()
        if not self.steps.prepare():
            raise RuntimeError(self.steps.reason)
        self.prepare_s = time.perf_counter() - started
        now_hits, now_misses = compile_cache_counts()
        self.cache_hits, self.cache_misses = now_hits - hits, now_misses - misses

    def measure(self, ids: torch.Tensor, tokens: int) -> CapturedDecode:
        """Prefill the prompt ``ids`` (eagerly, into the slot) and greedy-decode ``tokens``
        tokens (the first from the prefill) with captured steps."""
        adapter, slot, n = self.adapter, self.pool.slots[0], ids.shape[0]
        keys, values = self.pool.buffers(slot)
        produced = [int(adapter.forward(ids, torch.arange(n), adapter.cache_over(keys, values, 0)).argmax())]
        eager_host_ms, eager_launches = _eager_step(adapter, self.pool, Row(slot, produced, n))
        launches = profile_counts(lambda: self.steps.run([Row(slot, produced, n)])).launches
        host: list[float] = []
        _sync(adapter.device)
        start = time.perf_counter()
        for i in range(tokens - 1):
            issued = time.perf_counter()
            logits = self.steps.run([Row(slot, [produced[-1]], n + i)])
            host.append(time.perf_counter() - issued)
            produced.append(int(logits.last(0).argmax()))  # the host reads each token, as generate does
        elapsed = time.perf_counter() - start
        host.sort()
        return CapturedDecode(
            tokens_per_s=(tokens - 1) / elapsed if tokens > 1 else float("nan"),
            step_host_ms=host[len(host) // 2] * 1000 if host else float("nan"),
            eager_step_host_ms=eager_host_ms,
            launches=launches,
            eager_launches=eager_launches,
            tokens=produced,
        )


@dataclass
class EngineDecode:
    """One prompt's decode through the engine's own calls (``KVBoost.stream``).

    Attributes:
        tokens_per_s: Tokens after the first over the time from the first token to the last
            piece streamed.
        write_back_ms: From the last piece to the call's end (the write-back's staging: the
            copies into host memory and the tier puts run after the call).
        flush_ms: How long ``engine.flush()`` then waited for those.
        copy_gb_per_s: The write-back's copies into host memory in that call (GB/s; NaN when it
            copied nothing).
        found_share: Share of the prompt's tokens a second call right after the first
            (before the flush) read from cache.
        drafted_share: Share of the generated tokens that were accepted drafts.
        tokens_per_step: Tokens after the first per decode step.
        captured_steps: Steps the call ran as captured graphs.
        tokens: The generated tokens.
    """

    tokens_per_s: float
    write_back_ms: float
    flush_ms: float
    copy_gb_per_s: float
    found_share: float
    drafted_share: float
    tokens_per_step: float
    captured_steps: int
    tokens: list[int]


def engine_decode(engine, prompt: str, tokens: int) -> EngineDecode:
    """Greedy-decode ``tokens`` tokens of ``prompt`` through ``engine.stream`` (what
    ``generate`` runs), timing the first token, the last piece and the call's end."""
    before = engine.captured_steps_run or 0
    copies = internals(engine).cache.copies
    copied, copying = copies.bytes_copied, copies.seconds_copying
    start = time.perf_counter()  # the engine takes its own start just after, in stream()
    stream = engine.stream(prompt, max_new_tokens=tokens)
    last = start
    for _ in stream:
        last = time.perf_counter()
    end = time.perf_counter()
    again = engine.generate(prompt, max_new_tokens=1)  # what the call stored, before it reached the tiers
    flushed = time.perf_counter()
    engine.flush()
    flush_ms = (time.perf_counter() - flushed) * 1000
    copied, copying = copies.bytes_copied - copied, copies.seconds_copying - copying
    result = stream.result
    steps = result.generated_tokens - 1
    seconds = last - (start + result.ttft_ms / 1000)  # first token to last piece
    return EngineDecode(
        tokens_per_s=steps / seconds if steps > 0 and seconds > 0 else float("nan"),
        write_back_ms=(end - last) * 1000,
        flush_ms=flush_ms,
        copy_gb_per_s=copied / copying / 1e9 if copied and copying > 0 else float("nan"),
        found_share=again.cached_tokens / again.prompt_tokens,
        drafted_share=result.drafted_tokens / max(1, result.generated_tokens),
        tokens_per_step=steps / max(1, result.decode_steps),
        captured_steps=(engine.captured_steps_run or 0) - before,
        tokens=list(result.token_ids),
    )


def split_margin(tokens: list[int], reference: list[int], margins: list[float]) -> float | None:
    """The reference's logit margin (top less second) at the first token where ``tokens``
    part from ``reference``; ``None`` when they do not part."""
    split = same_prefix(tokens, reference)
    return margins[split] if split < min(len(tokens), len(reference), len(margins)) else None


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count
