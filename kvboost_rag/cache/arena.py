"""Host memory for stored K/V, allocated in large segments once and reused as entries leave.

The write-back copies every chunk it stores into host memory (the memory tier's copy of it,
which the disk and Redis tiers serialize from). Allocating that memory per chunk costs page
faults on a CPU (fresh memory is mapped one page at a time on its first write) and, on CUDA,
page-locking per tensor (``pin_memory()``: a driver call per chunk, then a third copy).
:class:`HostArena` instead carves tensors out of a few large segments (page-locked on CUDA, so
copies from the device are asynchronous DMA) and takes a tensor's range back when the last
Python reference to it is gone (the memory tier evicted the entry, the disk tier wrote it):
in steady state, storing a chunk allocates nothing.

Ranges are first-fit over each segment's sorted free list; freed ranges merge with their free
neighbours. A request no free range holds adds a segment (:attr:`HostArena.segments` counts
them); segments are never given back while the arena lives.

Caution: a tensor taken from the arena must be kept (not only views of it) while anything
reads it: its range is freed when that tensor object is collected, and views made from it do
not hold it (they hold the segment).
"""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from math import prod

import torch

logger = logging.getLogger(__name__)

#: Bytes of a new segment (a request larger than this gets a segment of its own size).
SEGMENT_BYTES = 64 * 1024**2
#: Every range starts on a multiple of this many bytes.
ALIGNMENT = 64


class _Segment:
    """One allocation and its free ranges (``(start, length)`` in elements, sorted, merged)."""

    def __init__(self, elements: int, dtype: torch.dtype, pinned: bool) -> None:
        with torch.inference_mode(False):  # an ordinary tensor: views are usable anywhere
            self.storage = torch.empty(elements, dtype=dtype, pin_memory=pinned)  # [elements]
        self.free: list[tuple[int, int]] = [(0, elements)]

    def take(self, length: int) -> int | None:
        """Start of a free range of ``length`` elements, now taken; ``None`` if none fits."""
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
    """

    def __init__(self, dtype: torch.dtype, pinned: bool = False, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dtype, self.pinned = dtype, pinned
        self._element = torch.empty((), dtype=dtype).element_size()
        self._align = max(1, ALIGNMENT // self._element)
        self._segment_elements = max(self._align, segment_bytes // self._element)
        self._segments: list[_Segment] = []
        self._lock = threading.RLock()  # a range freed while the arena is busy may call back in
        self._taken = 0
        #: Tensors handed out so far.
        self.tensors_taken = 0

    @property
    def segments(self) -> int:
        """Segments allocated so far (each one allocation of host memory)."""
        with self._lock:
            return len(self._segments)

    @property
    def used_bytes(self) -> int:
        """Bytes of the ranges handed out and not yet back."""
        with self._lock:
            return self._taken * self._element

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (uninitialized) whose memory returns to the arena
        when the tensor is collected."""
        length = -(-max(1, prod(shape)) // self._align) * self._align
        with self._lock:
            segment, start = self._find(length)
            self._taken += length
            self.tensors_taken += 1
        tensor = segment.storage[start : start + prod(shape)].view(shape)
        finalizer = weakref.finalize(tensor, self._give_back, segment, start, length)
        finalizer.atexit = False
        return tensor

    def _find(self, length: int) -> tuple[_Segment, int]:
        for segment in self._segments:
            start = segment.take(length)
            if start is not None:
                return segment, start
        segment = _Segment(max(self._segment_elements, length), self.dtype, self.pinned)
        self._segments.append(segment)
        logger.debug("host arena: segment %d of %d bytes", len(self._segments), segment.storage.numel() * self._element)
        start = segment.take(length)
        assert start == 0
        return segment, start

    def _give_back(self, segment: _Segment, start: int, length: int) -> None:
        with self._lock:
            segment.give_back(start, length)
            self._taken -= length
