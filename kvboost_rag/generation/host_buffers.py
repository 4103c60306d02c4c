"""K/V buffers reused from one request to the next on a CPU.

Every prompt's K and V are written into ``[layers, kv_heads, capacity, head_dim]`` buffers
(the stitch, the model's rows, the decoded tokens). Fresh buffers of this size come from the
operating system zero-filled, one page at a time on their first write: for the embedded
model's 120 MB at 2.6k tokens that cost 25-32 ms a call on the development machine, against
4.4 ms to write the same buffers again. :class:`HostBufferPool` keeps the buffers of finished
requests and lends them to later ones, so a call writes memory already mapped.

A buffer is lent through a :class:`BufferLease` (:class:`~kvboost_rag.generation.slots.Lease`):
it goes back to the pool only when the engine loop and the request (its write-back) are both
done with it. Capacities are rounded up to :data:`GRANULE` tokens, and a request takes an idle
buffer of its rounded capacity, else a new one: it holds exactly the bytes the batch's places
admitted it for. The pool counts what it lent and what it keeps idle: idle buffers are kept within
``max_idle_bytes`` and within what ``max_bytes`` leaves beside the lent ones (oldest dropped
first), and idle ones are dropped before new buffers are allocated beyond ``max_bytes``, so
lent and idle buffers together stay within ``max_bytes`` whenever the lent ones do. On a GPU the
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
        max_bytes: Most bytes of lent and idle buffers together before idle ones are dropped
            (``max_batch_cache_bytes``: the lent ones are bounded by the batch's places).
    """

    def __init__(self, allocate: Callable[[int], Buffers], max_idle_bytes: int, max_bytes: int | None = None) -> None:
        self._allocate = allocate
        self.max_idle_bytes = max_idle_bytes
        self.max_bytes = max_idle_bytes if max_bytes is None else max_bytes
        self._idle: list[Buffers] = []  # oldest first
        self._lent_bytes = 0
        self._bytes_per_token = 0  # of the buffers, once one pair was allocated
        self._lock = threading.RLock()  # buffers may come back from a finalizer, at any point

    @property
    def lent_bytes(self) -> int:
        """Bytes of the buffers lent now (not back yet)."""
        with self._lock:
            return self._lent_bytes

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

    @staticmethod
    def capacity_for(tokens: int) -> int:
        """Capacity of the buffers lent for ``tokens``: rounded up to :data:`GRANULE`."""
        return -(-max(1, tokens) // GRANULE) * GRANULE

    def lease(self, capacity: int) -> BufferLease:
        """Buffers of :meth:`capacity_for` ``capacity`` tokens: an idle pair of that capacity
        (so a request holds the bytes it was admitted for), else new ones (idle ones are
        dropped first when lent, idle and new would pass ``max_bytes``)."""
        rounded = self.capacity_for(capacity)
        with self._lock:
            chosen = next((b for b in self._idle if _capacity(b) == rounded), None)
            if chosen is not None:
                self._idle = [b for b in self._idle if b is not chosen]
                self._lent_bytes += _nbytes(chosen)
            else:  # idle ones that would pass the budget beside the new ones go first
                self._trim(self.max_bytes - self._lent_bytes - rounded * self._bytes_per_token)
        if chosen is not None:
            return BufferLease(self, chosen, reused=True)
        buffers = self._allocate(rounded)
        with self._lock:
            self._lent_bytes += _nbytes(buffers)
            self._bytes_per_token = _nbytes(buffers) // max(1, _capacity(buffers))
            self._trim(self.max_bytes - self._lent_bytes)
        return BufferLease(self, buffers)

    def give_back(self, buffers: Buffers) -> None:
        """Keep ``buffers`` for later requests (the oldest idle ones go beyond the budgets)."""
        with self._lock:
            self._lent_bytes -= _nbytes(buffers)
            self._idle.append(buffers)
            self._trim(min(self.max_idle_bytes, self.max_bytes - self._lent_bytes))

    def _trim(self, room: int) -> None:
        """Drop the oldest idle buffers until they take at most ``room`` bytes (under the lock)."""
        total = sum(_nbytes(b) for b in self._idle)
        while self._idle and total > max(0, room):
            total -= _nbytes(self._idle.pop(0))


class BufferLease(Lease):
    """One request's buffers from a :class:`HostBufferPool`.

    Args:
        pool: The pool they go back to.
        buffers: The K and V buffers lent.
        reused: They were lent before: filled as new memory is (where torch fills it) when the
            request first asks for them (they came back once no view of the previous
            request's K/V was left).
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
