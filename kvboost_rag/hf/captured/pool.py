"""The static K/V pool of captured steps: fixed slots in one preallocated buffer.

A captured step (:mod:`kvboost_rag.hf.captured.steps`) reads and writes K/V at addresses fixed
when its graph was built, so the sequences it decodes live in one pool allocated once: per K
and per V one ``[layers, kv_heads, tokens, head_dim]`` buffer whose token axis is cut into
slots. Each slot holds one sequence (its prompt and the tokens decoded after it) and has a
fixed capacity from a few powers of two, up to the model's context window; how many slots of
each capacity is planned once from a memory budget (:func:`plan_capacities`). A sequence that
finds no free slot large enough decodes on the eager path.

A slot's K/V is a ``[layers, kv_heads, capacity, head_dim]`` view of the pool
(:meth:`SlotPool.buffers`): the prefill writes a prompt's K/V straight into it and
:meth:`~kvboost_rag.hf.adapter.ModelAdapter.cache_over` builds the usual
:class:`~kvboost_rag.hf.caches.BufferedCache` over it, so every eager path (probe, blend
pass, lookahead) works on a slot unchanged. The view is strided, not contiguous: all slots
share one token axis per layer and head, so one attention call per layer reads the rows of
any slots, wherever they are, with no copy (:mod:`kvboost_rag.hf.captured.attention`).

After the slots comes a scratch region that padded tokens write to: a step padded to its
token bucket never writes into a slot where a real token did not.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvboost_rag.cache.codec import KVLayout
from kvboost_rag.cache.quant import unquantized_kv_bytes_per_token
from kvboost_rag.errors import InvalidInputError

#: Tokens per attention block: slots start on a block boundary, so the blocks an attention
#: call reads belong to one slot each (FlexAttention's default block size).
KV_BLOCK = 128
#: Smallest slot capacity a plan gives out.
MIN_CAPACITY = 1024
#: Most slots of one capacity a plan gives out (the largest batch bucket of a decode step).
MAX_SLOTS_PER_CAPACITY = 8


def round_to_block(tokens: int) -> int:
    """``tokens`` rounded up to a whole number of :data:`KV_BLOCK` blocks."""
    return -(-tokens // KV_BLOCK) * KV_BLOCK


def plan_capacities(
    budget_tokens: int,
    max_capacity: int,
    min_capacity: int = MIN_CAPACITY,
    max_slots_per_capacity: int = MAX_SLOTS_PER_CAPACITY,
) -> list[int]:
    """The slot capacities a pool of ``budget_tokens`` tokens holds.

    Capacities are powers of two from ``min_capacity`` up to ``max_capacity`` (itself the last
    capacity when it is not a power of two). Slots are handed out in rounds, largest capacity
    first, one slot per capacity and round while the budget lasts, so a budget that holds one
    slot of each capacity gets one of each before any capacity gets a second.

    Args:
        budget_tokens: Tokens the pool may hold in all.
        max_capacity: Largest capacity (the model's context window, usually).
        min_capacity: Smallest capacity.
        max_slots_per_capacity: Most slots of one capacity.

    Returns:
        Capacities, largest first; empty when not even one ``min_capacity`` slot fits.
    """
    top = round_to_block(max(max_capacity, 1))
    capacities: list[int] = []
    size = round_to_block(min(min_capacity, top))
    while size < top:
        capacities.append(size)
        size *= 2
    capacities.append(top)
    capacities.reverse()
    planned: list[int] = []
    left = budget_tokens
    for _ in range(max_slots_per_capacity):
        added = False
        for capacity in capacities:
            if capacity <= left:
                planned.append(capacity)
                left -= capacity
                added = True
        if not added:
            break
    return sorted(planned, reverse=True)


@dataclass(frozen=True)
class Slot:
    """One sequence's place in a :class:`SlotPool`.

    Attributes:
        index: Its number in the pool.
        start: Its first row on the pool's token axis.
        capacity: Tokens it holds (prompt and decoded tokens).
    """

    index: int
    start: int
    capacity: int


class SlotPool:
    """Preallocated K/V for the sequences captured steps decode.

    Args:
        layout: The model's K/V layout.
        capacities: Capacity of each slot (each rounded up to whole :data:`KV_BLOCK` blocks).
        dtype: The model's dtype.
        device: The model's device.
        scratch_tokens: Rows after the slots that padded tokens write to (the largest token
            bucket of the steps that use the pool).
        opened: Whether slots are handed out from the start; else only once :meth:`open` is
            called (the steps that decode in them are ready).

    Raises:
        InvalidInputError: No slot, or no scratch row.
    """

    def __init__(
        self,
        layout: KVLayout,
        capacities: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        scratch_tokens: int,
        opened: bool = True,
    ) -> None:
        if not capacities:
            raise InvalidInputError("a slot pool needs at least one slot: raise its memory budget")
        if scratch_tokens < 1:
            raise InvalidInputError(f"scratch_tokens must be at least 1, got {scratch_tokens}")
        self.layout = layout
        starts: list[Slot] = []
        offset = 0
        for index, capacity in enumerate(capacities):
            size = round_to_block(capacity)
            starts.append(Slot(index, offset, size))
            offset += size
        self.slots: tuple[Slot, ...] = tuple(starts)
        #: First row of the scratch region (after the last slot).
        self.scratch_start = offset
        #: Rows of the token axis: the slots and the scratch region.
        self.total_tokens = offset + round_to_block(scratch_tokens)
        shape = (layout.layers, layout.kv_heads, self.total_tokens, layout.head_dim)
        with torch.inference_mode(False):  # ordinary tensors: writable in and out of inference mode
            # Zeros, not empty: padded queries read the scratch region, and finite keys keep
            # their (ignored) outputs finite.
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros_like(self.keys)
        self._free = set(range(len(self.slots)))
        self._lock = threading.Lock()
        self._opened = opened

    @classmethod
    def planned(
        cls,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device | str,
        budget_bytes: int,
        max_capacity: int,
        scratch_tokens: int,
        opened: bool = True,
    ) -> SlotPool | None:
        """A pool whose slots (:func:`plan_capacities`) fit ``budget_bytes`` of K and V;
        ``None`` when not even the smallest slot fits."""
        per_token = unquantized_kv_bytes_per_token(layout, dtype)
        capacities = plan_capacities(budget_bytes // per_token - round_to_block(scratch_tokens), max_capacity)
        return cls(layout, capacities, dtype, device, scratch_tokens, opened) if capacities else None

    def open(self) -> None:
        """Hand slots out from now on (the steps that decode in them are ready)."""
        with self._lock:
            self._opened = True

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's K and V buffers."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def acquire(self, tokens: int) -> Slot | None:
        """The smallest free slot holding ``tokens`` tokens, now taken; ``None`` if none is free
        or the pool is not open yet (the sequence then decodes on the eager path). Safe from
        any thread."""
        with self._lock:
            if not self._opened:
                return None
            fitting = [self.slots[i] for i in self._free if self.slots[i].capacity >= tokens]
            if not fitting:
                return None
            slot = min(fitting, key=lambda s: (s.capacity, s.index))
            self._free.discard(slot.index)
            return slot

    def release(self, slot: Slot) -> None:
        """Give a slot back (its K/V stays until another sequence overwrites it).

        Raises:
            InvalidInputError: The slot is not taken, or not this pool's.
        """
        with self._lock:
            if slot.index >= len(self.slots) or self.slots[slot.index] != slot or slot.index in self._free:
                raise InvalidInputError(f"slot {slot.index} is not taken from this pool")
            self._free.add(slot.index)

    @property
    def free_slots(self) -> int:
        """Slots not taken now."""
        with self._lock:
            return len(self._free)

    def buffers(self, slot: Slot) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's K and V: ``[layers, kv_heads, capacity, head_dim]`` views of the pool
        (strided; write a prompt into them, or build a cache over them with
        :meth:`~kvboost_rag.hf.adapter.ModelAdapter.cache_over`)."""
        rows = slice(slot.start, slot.start + slot.capacity)
        return self.keys[:, :, rows], self.values[:, :, rows]
