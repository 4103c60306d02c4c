"""A request's slot of the captured steps' K/V pool, held until both its users are done.

A request that decodes through captured steps (:mod:`kvboost_rag.hf.captured`) prefills into
a slot of the pool and decodes there. Two parties use the slot after the prefill: the decode
worker (until the scheduler lets the sequence go, after its last step) and the request itself
(the write-back cuts the prompt's K/V from it after the answer). The slot goes back to the pool
only when both released it, so another request never prefills into K/V a step or a write-back
still reads.
"""

from __future__ import annotations

import threading

import torch

from kvboost_rag.hf.captured import Slot, SlotPool

#: The parties holding a slot.
HOLDERS = ("decode", "request")


class SlotLease:
    """One request's slot, given back once every holder released it.

    Args:
        pool: The pool.
        slot: The slot taken from it.
    """

    def __init__(self, pool: SlotPool, slot: Slot) -> None:
        self.pool, self.slot = pool, slot
        self._held = set(HOLDERS)
        self._lock = threading.Lock()

    @classmethod
    def take(cls, pool: SlotPool, tokens: int) -> SlotLease | None:
        """A lease of the smallest free slot holding ``tokens``; ``None`` when none is free."""
        slot = pool.acquire(tokens)
        return None if slot is None else cls(pool, slot)

    def buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's K and V (``capacity`` must fit it)."""
        if capacity > self.slot.capacity:
            raise ValueError(f"{capacity} tokens do not fit a slot of {self.slot.capacity}")
        return self.pool.buffers(self.slot)

    def release(self, holder: str) -> None:
        """``holder`` (``"decode"`` or ``"request"``) is done with the slot (again: nothing)."""
        with self._lock:
            if holder not in self._held:
                return
            self._held.discard(holder)
            last = not self._held
        if last:
            self.pool.release(self.slot)

    @property
    def released(self) -> bool:
        """Whether the slot went back to the pool."""
        with self._lock:
            return not self._held
