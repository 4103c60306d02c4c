"""K/V buffers reused from one request to the next on a CPU.

Every prompt's K and V are written into ``[layers, kv_heads, capacity, head_dim]`` buffers
(the stitch, the model's rows, the decoded tokens). Fresh buffers of this size come from the
operating system zero-filled, one page at a time on their first write: for the embedded
model's 120 MB at 2.6k tokens that cost 25-32 ms a call on the development machine, against
4.4 ms to write the same buffers again. :class:`HostBufferPool` keeps the buffers of finished
requests and lends them to later ones, so a call writes memory already mapped.

A buffer is lent through a :class:`BufferLease` (:class:`~kvboost_rag.generation.slots.Lease`):
it goes back to the pool only when the engine loop and the request (its write-back) are both
done with it. Capacities are rounded up to :data:`GRANULE` tokens, and a request takes the
smallest idle buffer that holds it, if that is at most twice what it needs; otherwise a new
one. Idle buffers beyond the pool's byte budget are dropped, oldest first. On a GPU the
caching allocator already reuses memory, and captured steps lend slots of their own pool: the
engine builds this pool only for models on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kvboost_rag.generation.slots import Lease

#: Capacities are rounded up to a multiple of this many tokens (so prompts of similar
#: lengths share buffers).
GRANULE = 1024

Buffers = tuple[torch.Tensor, torch.Tensor]


def _capacity(buffers: Buffers) -> int:
    return buffers[0].shape[2]


def _nbytes(buffers: Buffers) -> int:
    return sum(t.numel() * t.element_size() for t in buffers)


def _fill_uninitialized(buffers: Buffers) -> None:
    """What ``torch.empty`` does to new memory when torch is asked to fill it (deterministic
    mode with ``fill_uninitialized_memory``): NaN, so a reused buffer hides no read of a row
    nobody wrote."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        for tensor in buffers:
            tensor.fill_(float("nan"))


class HostBufferPool:
    """Idle K/V buffers of finished requests, lent to the next ones.

    Args:
        allocate: Makes new ``[layers, kv_heads, capacity, head_dim]`` K and V buffers for a
            capacity (:meth:`~kvboost_rag.hf.adapter.ModelAdapter.buffers`).
        max_idle_bytes: Most bytes of idle buffers kept; beyond it the oldest are dropped.
    """

    def __init__(self, allocate: Callable[[int], Buffers], max_idle_bytes: int) -> None:
        self._allocate = allocate
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[Buffers] = []  # oldest first
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes of the idle buffers held now."""
        with self._lock:
            return sum(_nbytes(b) for b in self._idle)

    @property
    def idle_buffers(self) -> int:
        """Idle K/V buffer pairs held now."""
        with self._lock:
            return len(self._idle)

    def lease(self, capacity: int) -> BufferLease:
        """Buffers of at least ``capacity`` tokens: an idle pair that holds them at most twice
        over (the smallest such), else new ones of ``capacity`` rounded up to :data:`GRANULE`."""
        with self._lock:
            fitting = [b for b in self._idle if capacity <= _capacity(b) <= 2 * max(capacity, GRANULE)]
            chosen = min(fitting, key=_capacity) if fitting else None
            if chosen is not None:
                self._idle = [b for b in self._idle if b is not chosen]
        if chosen is None:
            return BufferLease(self, self._allocate(-(-capacity // GRANULE) * GRANULE))
        return BufferLease(self, chosen, reused=True)

    def give_back(self, buffers: Buffers) -> None:
        """Keep ``buffers`` for later requests (the oldest idle ones go beyond the budget)."""
        with self._lock:
            self._idle.append(buffers)
            total = sum(_nbytes(b) for b in self._idle)
            while self._idle and total > self.max_idle_bytes:
                total -= _nbytes(self._idle.pop(0))


class BufferLease(Lease):
    """One request's buffers from a :class:`HostBufferPool`.

    Args:
        pool: The pool they go back to.
        buffers: The K and V buffers lent.
        reused: They were lent before: filled as new memory is (where torch fills it) when the
            request first asks for them, inside its prefill (a write-back's staged views of the
            previous request's K/V may be read until then, by a prefill that holds the model).
    """

    def __init__(self, pool: HostBufferPool, buffers: Buffers, reused: bool = False) -> None:
        super().__init__()
        self.pool, self._buffers, self._unfilled = pool, buffers, reused

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold."""
        return _capacity(self._buffers)

    def buffers(self, capacity: int) -> Buffers:
        """The lent K and V (``capacity`` must fit them)."""
        if capacity > self.capacity:
            raise ValueError(f"{capacity} tokens do not fit buffers of {self.capacity}")
        if self._unfilled:
            self._unfilled = False
            _fill_uninitialized(self._buffers)
        return self._buffers

    def _give_back(self) -> None:
        self.pool.give_back(self._buffers)
