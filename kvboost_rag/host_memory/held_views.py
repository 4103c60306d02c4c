"""Views of lent memory that hold it: the memory goes back only once every view of it is gone.

A finished prompt's K/V stays in its lent buffers (on a CPU) until the write-back has copied
what it stores. Meanwhile views of those buffers are staged in the tier stack, and any request
that looks a chunk up gets one (a lookup runs on the caller's thread; the engine loop reads the
view later, in a prefill step). Giving the buffers back when the copier is done would let the
next request write into memory such a view still reads. :func:`watched_aliases` makes the
views from aliases of the buffers whose storages are their own (:func:`held_alias`:
:func:`torch.from_numpy` over the same memory), so the last view collected, wherever it is (the
store, a lookup, a job), is what gives the buffers back. The host arena hands out its ranges
the same way.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch


class _Countdown:
    """Runs ``on_done`` once, when :meth:`one_gone` was called ``count`` times."""

    def __init__(self, count: int, on_done: Callable[[], None]) -> None:
        self._left, self._on_done = count, on_done
        self._lock = threading.Lock()

    def one_gone(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            self._on_done()


def held_alias(memory: np.ndarray, dtype: torch.dtype, on_gone: Callable[[], None]) -> torch.Tensor:
    """A 1-D ``dtype`` tensor over the bytes of ``memory`` whose storage holds ``memory``:
    ``on_gone()`` runs once it and every view made from it have been collected (in the thread
    that let go of the last one). The caller keeps no reference to ``memory``."""
    weakref.finalize(memory, on_gone).atexit = False
    with torch.inference_mode(False):  # an ordinary tensor: views are usable anywhere
        return torch.from_numpy(memory).view(dtype)


def watched_aliases(tensors: Sequence[torch.Tensor], on_gone: Callable[[], None]) -> list[torch.Tensor]:
    """Aliases of host ``tensors`` (the same memory, shape, strides and dtype) whose storages
    are their own: ``on_gone()`` runs once, when every alias and every view made from them has
    been collected.

    Args:
        tensors: CPU tensors whose last dimension is contiguous.
        on_gone: What gives their memory back.
    """
    if not tensors:
        on_gone()
        return []
    countdown = _Countdown(len(tensors), on_gone)
    # ``.numpy()`` of the bytes keeps the strides: the alias views the same elements.
    return [held_alias(t.detach().view(torch.uint8).numpy(), t.dtype, countdown.one_gone) for t in tensors]
