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


def _name(func: torch._ops.OpOverload) -> str:
    return func.overloadpacket.__name__


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

    def __init__(self) -> None:
        super().__init__()
        self.counts = OpCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.by_name[_name(func)] += 1
        return func(*args, **(kwargs or {}))
