"""A request's K/V buffers on loan, held until both their users are done.

A request that decodes through captured steps (:mod:`kvboost_rag.hf.captured`) prefills into
a slot of the pool and decodes there; on a CPU a request prefills into buffers of the
:class:`~kvboost_rag.generation.host_buffers.HostBufferPool`. Either way two parties use the
buffers after the prefill: the engine loop (until it lets the sequence go, after
its last step) and the request itself (the write-back cuts the prompt's K/V from them after the
answer). They go back only when both released them, so another request never prefills into
K/V a step or a write-back still reads.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvboost_rag.hf.captured import Slot, SlotPool

#: The parties holding a lease.
HOLDERS = ("decode", "request")


class Lease(ABC):
    """K/V buffers of one request, given back once every holder released them (subclasses say
    where they come from and where they go back to).

    Attributes:
        slot: The captured steps' slot the buffers are, or ``None`` (the request decodes on
            the eager path).
    """

    slot: Slot | None = None

    def __init__(self) -> None:
        self._held = set(HOLDERS)
        self._lock = threading.Lock()
        self._when_returned: list[Callable[[], None]] = []

    @abstractmethod
    def buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[layers, kv_heads, capacity or more, head_dim]`` K and V (``capacity`` must fit).

        Raises:
            ValueError: ``capacity`` does not fit the lease.
        """

    @abstractmethod
    def _give_back(self) -> None:
        """Return the buffers to where they came from (the last holder released them)."""

    def release(self, holder: str) -> None:
        """``holder`` (``"decode"`` or ``"request"``) is done with the buffers (again: nothing)."""
        with self._lock:
            if holder not in self._held:
                return
            self._held.discard(holder)
            last = not self._held
            callbacks, self._when_returned = (self._when_returned, []) if last else ([], self._when_returned)
        if last:
            try:
                self._give_back()
            finally:
                for callback in callbacks:
                    callback()

    def when_returned(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the buffers went back (at once if they did)."""
        with self._lock:
            if self._held:
                self._when_returned.append(callback)
                return
        callback()

    @property
    def released(self) -> bool:
        """Whether the buffers went back."""
        with self._lock:
            return not self._held


class SlotLease(Lease):
    """One request's slot of the captured steps' pool.

    Args:
        pool: The pool.
        slot: The slot taken from it.
    """

    def __init__(self, pool: SlotPool, slot: Slot) -> None:
        super().__init__()
        self.pool, self.slot = pool, slot

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

    def _give_back(self) -> None:
        self.pool.release(self.slot)
