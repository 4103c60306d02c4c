"""K/V buffers sized to each request, carved from reused host memory on a CPU.

Every prompt's K and V are written into ``[layers, kv_heads, capacity, head_dim]`` buffers
(the stitch, the model's rows, the decoded tokens). Fresh buffers of this size come from the
operating system zero-filled, one page at a time on their first write: for the embedded
model's 120 MB at 2.6k tokens that cost 25-32 ms a call on the development machine, against
4.4 ms to write the same buffers again. :class:`HostBufferPool` carves each request's buffers
from large segments of a :class:`~kvboost_rag.host_memory.arena.HostArena` that stay mapped from one
request to the next, so a call writes memory already mapped.

**Sized to the work.** A request's capacity is rounded up to :data:`BLOCK` tokens (not to a
granule of a thousand): it holds its tokens' K/V plus less than one block, and the bytes the
batch's places admit it for are exactly the bytes it is lent.

**Given back by its handle.** A buffer is lent through a :class:`BufferLease`
(:class:`~kvboost_rag.generation.slots.Lease`): its range goes back to the arena when the engine
loop and the request (its write-back) have both released it, by name, never by the garbage
collector. Wholly free segments are kept up to ``max_idle_bytes`` for the next requests; when
the segments would pass ``max_bytes``, the wholly free ones go back to the system first. On a GPU
the caching allocator already reuses memory, and captured steps lend slots of their own pool:
the engine builds this pool only for models on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from kvboost_rag.host_memory.arena import HostArena, poison, poison_requested
from kvboost_rag.generation.slots import Lease

#: Capacities are rounded up to a multiple of this many tokens.
BLOCK = 64
#: Bytes of a segment at least (a larger pair gets a segment of its own size).
MIN_SEGMENT_BYTES = 64 * 1024**2

Buffers = tuple[torch.Tensor, torch.Tensor]


def _fill_uninitialized(buffers: Buffers) -> None:
    """What ``torch.empty`` does to new memory when torch is asked to fill it (deterministic
    mode with ``fill_uninitialized_memory``): NaN, so a reused range hides no read of a row
    nobody wrote."""
    if poison_requested():
        for tensor in buffers:
            poison(tensor)


class HostBufferPool:
    """K/V buffers of each request's size, carved from host memory kept mapped.

    Args:
        allocate: Makes ``[layers, kv_heads, capacity, head_dim]`` K and V buffers for a
            capacity (:meth:`~kvboost_rag.hf.adapter.ModelAdapter.buffers`): called once, for
            one token, to learn the layout and dtype.
        max_idle_bytes: Most bytes of wholly free segments kept for the next requests.
        max_bytes: Most bytes of segments before wholly free ones go back to the system
            (``max_batch_cache_bytes``: the lent buffers are bounded by the batch's places).
    """

    def __init__(self, allocate: Callable[[int], Buffers], max_idle_bytes: int, max_bytes: int | None = None) -> None:
        self._allocate = allocate
        self.max_idle_bytes = max_idle_bytes
        self.max_bytes = max_idle_bytes if max_bytes is None else max_bytes
        self._layout: tuple[tuple[int, ...], torch.dtype, int] | None = None
        self._arena: HostArena | None = None
        self._lent_bytes = 0
        self._lock = threading.Lock()

    @property
    def lent_bytes(self) -> int:
        """Bytes of the buffers lent now (not back yet)."""
        with self._lock:
            return self._lent_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of host memory the pool keeps mapped beyond the lent buffers."""
        arena = self._arena
        return 0 if arena is None else max(0, arena.segment_bytes - arena.used_bytes)

    @property
    def segment_bytes(self) -> int:
        """Bytes of the segments of host memory held now."""
        return 0 if self._arena is None else self._arena.segment_bytes

    @property
    def segments(self) -> int:
        """Segments of host memory held now."""
        return 0 if self._arena is None else self._arena.segments

    @staticmethod
    def capacity_for(tokens: int) -> int:
        """Capacity of the buffers lent for ``tokens``: rounded up to :data:`BLOCK`."""
        return -(-max(1, tokens) // BLOCK) * BLOCK

    def pair_bytes(self, tokens: int) -> int:
        """Bytes of the K and V buffers lent for ``tokens``."""
        return 2 * self._known_layout()[2] * self.capacity_for(tokens)

    def lease(self, capacity: int) -> BufferLease:
        """K and V buffers of :meth:`capacity_for` ``capacity`` tokens, carved from kept memory
        (wholly free segments go back first when a new one would pass ``max_bytes``)."""
        rounded = self.capacity_for(capacity)
        (layers, heads, _, dim), dtype, token_bytes = self._known_layout()
        half = token_bytes * rounded  # K, and V likewise: two ranges
        arena = self._known_arena(half)
        if not arena.fits(half) and arena.segment_bytes + 2 * half > self.max_bytes:
            arena.trim()  # what is wholly free goes first
        shape = (layers, heads, rounded, dim)
        (key_memory, keys_back), (value_memory, values_back) = arena.lend(half), arena.lend(half)
        with torch.inference_mode(False):  # ordinary views: a caller in inference mode or not may write them
            keys, values = (memory.view(dtype).view(shape) for memory in (key_memory, value_memory))
        with self._lock:
            self._lent_bytes += 2 * half
        return BufferLease(self, (keys, values), lambda: (keys_back(), values_back()))

    def returned(self, nbytes: int, give_back: Callable[[], None]) -> None:
        """A lease's buffers of ``nbytes`` came back: their range goes back to the arena."""
        with self._lock:
            self._lent_bytes -= nbytes
        give_back()

    def _known_layout(self) -> tuple[tuple[int, ...], torch.dtype, int]:
        """A 1-token K's shape, the dtype, and the bytes of one token's K (learnt once)."""
        if self._layout is None:
            keys, _ = self._allocate(1)
            self._layout = (tuple(keys.shape), keys.dtype, keys.numel() * keys.element_size())
        return self._layout

    def _known_arena(self, half: int) -> HostArena:
        with self._lock:
            if self._arena is None:
                segment = max(2 * half, min(max(MIN_SEGMENT_BYTES, self.max_idle_bytes // 2), self.max_bytes))
                self._arena = HostArena(torch.uint8, segment_bytes=segment, spare_bytes=self.max_idle_bytes)
            return self._arena


class BufferLease(Lease):
    """One request's buffers from a :class:`HostBufferPool`.

    Args:
        pool: The pool they go back to.
        buffers: The K and V buffers lent.
        give_back: Gives their range back to the pool's arena (once).
    """

    def __init__(self, pool: HostBufferPool, buffers: Buffers, give_back: Callable[[], None]) -> None:
        super().__init__()
        self.pool, self._buffers, self._give_back_range = pool, buffers, give_back
        self._unfilled = True
        #: Tokens the buffers hold.
        self.capacity: int = buffers[0].shape[2]

    def buffers(self, capacity: int) -> Buffers:
        """The lent K and V (``capacity`` must fit them); filled as new memory is (where torch
        fills it) when first asked for: the range may have held an earlier request's K/V."""
        if capacity > self.capacity:
            raise ValueError(f"{capacity} tokens do not fit buffers of {self.capacity}")
        if self._unfilled:
            self._unfilled = False
            _fill_uninitialized(self._buffers)
        return self._buffers

    def _give_back(self) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in self._buffers)
        self._buffers = ()  # type: ignore[assignment] - no view of the range is kept here
        self.pool.returned(nbytes, self._give_back_range)
