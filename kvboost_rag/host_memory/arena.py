"""Host memory for stored K/V, allocated in large segments and reused as entries leave.

The write-back copies every chunk it stores into host memory (the memory tier's copy of it,
which the disk and Redis tiers serialize from). Allocating that memory per chunk costs page
faults on a CPU (fresh memory is mapped one page at a time on its first write) and, on CUDA,
page-locking per tensor (``pin_memory()``: a driver call per chunk, then a third copy).
:class:`HostArena` instead carves tensors out of a few large segments (page-locked on CUDA, so
copies from the device are asynchronous DMA): in steady state, storing a chunk allocates
nothing.

**Held by reference.** A tensor the arena hands out has a storage of its own over its range
(:func:`~kvboost_rag.host_memory.held_views.held_alias` over a slice of the segment), so the tensor *and every view
of it* hold the range: it returns to the arena only when the last of them is collected,
whoever holds it (the memory tier, a staged entry, a reader of a lookup, a disk write).

**Returns never interleave with an update.** A range comes back when the collector drops the
last view of it, which may happen on any thread, including in the middle of the arena's own
work on this thread (an allocation there can run the collector). A returned range is therefore
queued, and the queue is applied only by a thread that holds the arena's (non-reentrant) lock,
before it lets go of it: a free list is never changed while another change of it is half done.

Ranges are first-fit over each segment's sorted free list; freed ranges merge with their free
neighbours. A request no free range holds adds a segment. A segment whose every range came
back is given back to the system when the wholly free ones kept already reach ``spare_bytes``
(by default one spare stays for the next writes), and :meth:`HostArena.trim` gives back every wholly free segment
(after ``clear_cache``).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from math import prod

import torch

from kvboost_rag.host_memory.held_views import held_alias

logger = logging.getLogger(__name__)

#: Bytes of a new segment (a request larger than this gets a segment of its own size).
SEGMENT_BYTES = 64 * 1024**2
#: Every range starts on a multiple of this many bytes.
ALIGNMENT = 64


def poison_requested() -> bool:
    """Whether torch is asked to fill new memory (deterministic mode with
    ``fill_uninitialized_memory``, as the test suites run): then what the arena hands out is
    filled the same way, each range when it is handed out, reused or not."""
    return torch.are_deterministic_algorithms_enabled() and bool(torch.utils.deterministic.fill_uninitialized_memory)


def poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` as torch fills new memory when asked to: NaN (floating point) or the
    dtype's largest value."""
    value = float("nan") if tensor.is_floating_point() else torch.iinfo(tensor.dtype).max
    tensor.fill_(value)


def _untouched_memory(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory as a 1-D ``uint8`` tensor, its pages not yet written: torch's
    fill of new memory (deterministic mode) would write the whole segment at once, so the
    ranges are filled one by one as they are handed out instead (page-locked memory is always
    written as it is locked)."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage(nbytes))


class _Segment:
    """One allocation and its free ranges (``(start, length)`` in bytes, sorted, merged)."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        with torch.inference_mode(False):  # an ordinary tensor: views are usable anywhere
            self.storage = _untouched_memory(nbytes, pinned)  # [nbytes]
        self.array = self.storage.numpy()  # the same memory, sliced into ranges
        self.nbytes = nbytes
        self.free: list[tuple[int, int]] = [(0, nbytes)]

    @property
    def wholly_free(self) -> bool:
        """Whether every range came back."""
        return self.free == [(0, self.nbytes)]

    def take(self, length: int) -> int | None:
        """Start of a free range of ``length`` bytes, now taken; ``None`` if none fits."""
        for i, (start, size) in enumerate(self.free):
            if size >= length:
                if size == length:
                    del self.free[i]
                else:
                    self.free[i] = (start + length, size - length)
                return start
        return None

    def give_back(self, start: int, length: int) -> None:
        """Return ``[start, start + length)``, merged with free neighbours."""
        i = bisect.bisect_left(self.free, (start, 0))
        if i < len(self.free) and start + length == self.free[i][0]:
            length += self.free[i][1]
            del self.free[i]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == start:
            start, length = self.free[i - 1][0], self.free[i - 1][1] + length
            del self.free[i - 1]
            i -= 1
        self.free.insert(i, (start, length))


class HostArena:
    """Contiguous host tensors of one dtype carved from reused segments.

    Args:
        dtype: Dtype of every tensor it hands out.
        pinned: Page-lock the segments (CUDA: asynchronous copies from and to the device).
        segment_bytes: Bytes of a new segment.
        spare_bytes: Bytes of wholly free segments kept for the next takes (default: one
            segment); beyond them a segment whose ranges all came back goes to the system.
    """

    def __init__(
        self, dtype: torch.dtype, pinned: bool = False, segment_bytes: int = SEGMENT_BYTES, spare_bytes: int | None = None
    ) -> None:
        self.dtype, self.pinned = dtype, pinned
        self._element = torch.empty((), dtype=dtype).element_size()
        self._segment_bytes = max(ALIGNMENT, segment_bytes)
        self._spare_bytes = self._segment_bytes if spare_bytes is None else spare_bytes
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()  # not re-entrant: a return during an update is queued
        self._returned: deque[tuple[_Segment, int, int]] = deque()  # ranges back, not yet applied
        self._taken = 0
        #: Tensors handed out so far.
        self.tensors_taken = 0

    @property
    def segments(self) -> int:
        """Segments allocated now (each one allocation of host memory)."""
        with self._locked():
            return len(self._segments)

    @property
    def segment_bytes(self) -> int:
        """Bytes of the segments allocated now (what the arena holds of host memory)."""
        with self._locked():
            return sum(segment.nbytes for segment in self._segments)

    @property
    def used_bytes(self) -> int:
        """Bytes of the ranges handed out and not yet back."""
        with self._locked():
            return self._taken

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (uninitialized, or filled as torch fills new memory
        where it is asked to: :func:`poison_requested`) whose range returns to the arena once it
        and every view of it are collected."""
        nbytes = max(1, prod(shape)) * self._element
        length = -(-nbytes // ALIGNMENT) * ALIGNMENT
        with self._locked():
            segment, start = self._find(length)
            self._taken += length
            self.tensors_taken += 1
        piece = segment.array[start : start + prod(shape) * self._element]
        tensor = held_alias(piece, self.dtype, partial(self._give_back, segment, start, length)).view(shape)
        if poison_requested():
            poison(tensor)
        return tensor

    def fits(self, nbytes: int) -> bool:
        """Whether a free range of the segments held now takes ``nbytes`` (no new segment)."""
        length = -(-max(1, nbytes) // ALIGNMENT) * ALIGNMENT
        with self._locked():
            return any(size >= length for segment in self._segments for _, size in segment.free)

    def lend(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
        """``nbytes`` of uninitialized memory (a 1-D ``uint8`` tensor; the borrower fills it
        where :func:`poison_requested`, knowing its dtype) held by the caller's handle: the returned call gives the range back (call it once, when no view of the
        memory is read any more; safe from any thread, the collector's included)."""
        length = -(-max(1, nbytes) // ALIGNMENT) * ALIGNMENT
        with self._locked():
            segment, start = self._find(length)
            self._taken += length
            self.tensors_taken += 1
        with torch.inference_mode(False):  # an ordinary view: writable in and out of inference mode
            memory = segment.storage[start : start + nbytes]
        return memory, partial(self._give_back, segment, start, length)

    def trim(self) -> int:
        """Give every wholly free segment back to the system; returns the bytes given back."""
        with self._locked():
            free = [segment for segment in self._segments if segment.wholly_free]
            self._segments = [segment for segment in self._segments if not segment.wholly_free]
        return sum(segment.nbytes for segment in free)

    def _find(self, length: int) -> tuple[_Segment, int]:
        for segment in self._segments:
            start = segment.take(length)
            if start is not None:
                return segment, start
        segment = _Segment(max(self._segment_bytes, length), self.pinned)
        self._segments.append(segment)
        logger.debug("host arena: segment %d of %d bytes", len(self._segments), segment.nbytes)
        start = segment.take(length)
        assert start == 0
        return segment, start

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock, with every range returned so far applied; ranges returned while it
        is held (by the collector on this thread, or by other threads) are applied before it
        is let go."""
        try:
            with self._lock:
                self._apply_returns()
                try:
                    yield
                finally:
                    self._apply_returns()
        finally:
            self._apply_returns_if_free()

    def _give_back(self, segment: _Segment, start: int, length: int) -> None:
        """A range's last view is gone (the collector calls this, on any thread, at any point)."""
        self._returned.append((segment, start, length))  # atomic: safe inside the arena's own work
        self._apply_returns_if_free()

    def _apply_returns_if_free(self) -> None:
        """Apply the queued returns now unless some thread (this one too) holds the lock; the
        holder applies them before it lets go."""
        while self._returned and self._lock.acquire(blocking=False):
            try:
                self._apply_returns()
            finally:
                self._lock.release()

    def _apply_returns(self) -> None:
        """Put the queued ranges back (under the lock)."""
        while self._returned:
            segment, start, length = self._returned.popleft()
            segment.give_back(start, length)
            self._taken -= length
            spare = sum(other.nbytes for other in self._segments if other is not segment and other.wholly_free)
            if segment.wholly_free and spare and spare + segment.nbytes > self._spare_bytes:
                self._segments = [other for other in self._segments if other is not segment]
