"""Counting the tensor operations one call dispatches: copies, host reads, all ops.

On a GPU every dispatched operation is a kernel launch (or several), every copy moves bytes
through the memory system, and every read of a tensor value on the host
(``int(t)``, ``t.item()``, ``t.tolist()``) waits for the device. :class:`OpCounter` counts
them on any device, CPU included, so a test or a benchmark can check that the engine's data
path does not grow with the number of stored chunks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
#: Operations that move tensor data (whole or gathered/scattered) rather than compute on it.
COPY_OPS: frozenset[str] = frozenset(
    {
        "copy_", "_to_copy", "clone", "cat", "stack", "index_copy", "index_copy_", "index_put", "index_put_",
        "index_select", "index", "gather", "scatter", "scatter_", "slice_scatter", "select_scatter",
        "masked_scatter", "_unsafe_index_put", "_unsafe_index",
    }
)
#: The operation a host read of a tensor value dispatches.
HOST_READ_OP = "_local_scalar_dense"
#: Operations that only describe a tensor (views, metadata): no kernel runs.
VIEW_OPS: frozenset[str] = frozenset(
    {
        "view", "_unsafe_view", "reshape", "slice", "select", "expand", "transpose", "t", "permute", "unsqueeze",
        "squeeze", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "narrow", "view_as",
        "lift_fresh", "_reshape_alias", "empty", "empty_like", "empty_strided", "new_empty", "is_pinned",
        "_has_compatible_shallow_copy_type", "unfold", "diagonal", "chunk", "movedim", "flatten", "sym_size",
        "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous", "size", "stride", "to",
        "lift_fresh", "resolve_conj", "resolve_neg", "_conj", "_neg_view",
    }
)


def _name(func: torch._ops.OpOverload | torch._ops.HigherOrderOperator) -> str:
    packet = getattr(func, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(getattr(func, "__name__", func))


@dataclass
class OpCounts:
    """What one block dispatched.

    Attributes:
        by_name: Dispatches per operation name (``aten`` overload packet names).
    """

    by_name: Counter[str] = field(default_factory=Counter)

    @property
    def copies(self) -> int:
        """Operations that move tensor data (:data:`COPY_OPS`)."""
        return sum(count for name, count in self.by_name.items() if name in COPY_OPS)

    @property
    def host_reads(self) -> int:
        """Reads of a tensor value on the host (a device sync on a GPU)."""
        return self.by_name[HOST_READ_OP]

    @property
    def kernels(self) -> int:
        """Operations that run a kernel (everything but views and metadata)."""
        return sum(count for name, count in self.by_name.items() if name not in VIEW_OPS)


class OpCounter(TorchDispatchMode):
    """Counts the operations dispatched inside the block (all threads' work in this thread).

    Example::

        with OpCounter() as counted:
            engine.generate(prompt, max_new_tokens=1)
        counted.counts.copies
    """

    #: Higher-order operators (compiled FlexAttention) pass through, counted once by name.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts = OpCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.by_name[_name(func)] += 1
        return func(*args, **(kwargs or {}))


#: CUDA runtime calls that block the host until the device catches up.
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})
#: CUDA runtime calls that launch a kernel.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})
#: How the CUDA runtime calls that launch a captured graph start (a whole step in one launch).
GRAPH_LAUNCH_PREFIX = "cudaGraphLaunch"
#: CUDA runtime calls that copy memory.
MEMCPY_CALLS = frozenset({"cudaMemcpyAsync", "cudaMemcpy"})


@dataclass
class RuntimeCounts:
    """What one call did, as the profiler saw it (works with compiled code, unlike a dispatch
    mode).

    Attributes:
        copies: ``aten::copy_`` calls (every tensor copy ends in one).
        host_reads: ``aten::_local_scalar_dense`` calls (a tensor value read on the host).
        launches: Kernel and graph launches (CUDA only; 0 on CPU).
        memcpys: Memory copies issued through the CUDA runtime (0 on CPU).
        syncs: Calls that made the host wait for the device (0 on CPU).
        graph_launches: Of ``launches``, those of captured CUDA graphs.
    """

    copies: int
    host_reads: int
    launches: int
    memcpys: int
    syncs: int
    graph_launches: int = 0


def profile_counts(call) -> RuntimeCounts:
    """Run ``call()`` under ``torch.profiler`` and count its copies, host reads, kernel and
    graph launches, runtime memory copies and synchronizations (every thread's CPU-side
    events)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        call()
    names = Counter(event.name for event in profiler.events())
    graphs = sum(count for name, count in names.items() if name.startswith(GRAPH_LAUNCH_PREFIX))
    return RuntimeCounts(
        copies=names["aten::copy_"],
        host_reads=names[f"aten::{HOST_READ_OP}"],
        launches=sum(names[n] for n in LAUNCH_CALLS) + graphs,
        memcpys=sum(names[n] for n in MEMCPY_CALLS),
        syncs=sum(names[n] for n in SYNC_CALLS),
        graph_launches=graphs,
    )
