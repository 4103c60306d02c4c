"""Tensors over arena memory that hold it: the memory goes back only once every view of it is gone.

The host arena (:mod:`kvboost_rag.host_memory.arena`) hands out stored chunks' tensors with
:func:`held_alias`: :func:`torch.from_numpy` over a range of a segment, whose storage holds the
range, so the tensor and every view made from it (the memory tier, a staged entry, a reader of
a lookup, a disk write) keep it until the last is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch


def held_alias(memory: np.ndarray, dtype: torch.dtype, on_gone: Callable[[], None]) -> torch.Tensor:
    """A 1-D ``dtype`` tensor over the bytes of ``memory`` whose storage holds ``memory``:
    ``on_gone()`` runs once it and every view made from it have been collected (in the thread
    that let go of the last one). The caller keeps no reference to ``memory``."""
    weakref.finalize(memory, on_gone).atexit = False
    with torch.inference_mode(False):  # an ordinary tensor: views are usable anywhere
        return torch.from_numpy(memory).view(dtype)
