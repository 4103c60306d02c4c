"""Copies of the K/V a write-back stores, out of a prompt's buffers into memory the cache owns.

A prompt's K/V sits in buffers that are lent (a captured steps' slot, reused host buffers):
once the call is over, the next request writes into them. The write-back therefore copies each
chunk it stores, in two steps that run on different threads:

- :meth:`HostCopies.gather`, on the request's thread when its answer is done: on CUDA one
  device-to-device copy per chunk's K and V into memory of their own (queued on the compute
  stream, so any later write into the buffers comes after it; the buffers can be lent again at
  once, and the device tier can hold these copies as they are); on a CPU nothing (the
  buffers stay lent until the second step has read them).
- :meth:`HostCopies.to_host`, on the write-back's worker thread: one copy per chunk's K and
  V into tensors of a :class:`~kvboost_rag.host_memory.arena.HostArena` (page-locked on CUDA:
  asynchronous DMA on a copy stream that first waits for what the compute stream has queued,
  then one wait for all of them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvboost_rag.host_memory.arena import HostArena


class HostCopies:
    """Gathers and host copies of stored K/V for a model on ``device``.

    Args:
        device: Where the model's K/V buffers are.
        dtype: Their dtype.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self._on_cuda = device.type == "cuda"
        #: Host memory the copies are carved from (page-locked on CUDA).
        self.arena = HostArena(dtype, pinned=self._on_cuda)
        self._stream = torch.cuda.Stream(device) if self._on_cuda else None
        #: Bytes :meth:`to_host` copied so far, and the seconds it took (its throughput).
        self.bytes_copied = 0
        self.seconds_copying = 0.0

    @property
    def frees_buffers_at_once(self) -> bool:
        """Whether the buffers :meth:`gather` read may be written again as soon as it returned
        (on CUDA: its copies are queued before any later write), rather than only after
        :meth:`to_host`."""
        return self._on_cuda

    def gather(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (views of a prompt's buffers) as :meth:`to_host` will read them: on CUDA,
        contiguous device copies (queued, not waited for); on a CPU, the views themselves."""
        if not self._on_cuda:
            return list(tensors)
        return [tensor.clone(memory_format=torch.contiguous_format) for tensor in tensors]

    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous host copies of ``tensors`` (what :meth:`gather` returned) in arena memory,
        complete when this returns. Call it from one thread at a time."""
        if not tensors:
            return []
        started = time.perf_counter()
        copies = [self.arena.take(tuple(tensor.shape)) for tensor in tensors]
        if self._stream is None:
            for copy, tensor in zip(copies, tensors):
                copy.copy_(tensor)
        else:
            # Everything the compute stream queued so far comes first: the gathers, and reads of
            # arena memory freed since (a promotion to the device tier) before it is written again.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for copy, tensor in zip(copies, tensors):
                    copy.copy_(tensor, non_blocking=True)
            self._stream.synchronize()
        self.seconds_copying += time.perf_counter() - started
        self.bytes_copied += sum(copy.numel() * copy.element_size() for copy in copies)
        return copies
