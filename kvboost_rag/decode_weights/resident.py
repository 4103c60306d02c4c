"""Giving back memory the engine's load no longer needs: the pages of the input embeddings, and
the heap its weight copies' temporaries left free.

A model loaded from safetensors maps its weights from the file, and a page of a weight is
resident once something reads it. The engine's fingerprint (:mod:`kvboost_rag.hf.fingerprint`)
reads every weight once at load, but the input embedding table is only ever read a row per
token of the prompts it sees: left resident, Qwen2.5 0.5B's untied 151,936 x 896 table keeps
544 MB in memory of which a corpus touches a small part. :func:`page_out` asks the kernel to
reclaim a tensor's pages (``madvise(MADV_PAGEOUT)``, Linux 5.4 and later): pages mapped from
the file are dropped from this process and read back from the file when a row is next looked
up; anonymous pages (a model built in memory or converted at load) are swapped out where there
is swap and otherwise stay. Either way the values are unchanged: nothing is discarded, only
where the bytes live.

Making the decode weights' int8 copies (:mod:`kvboost_rag.decode_weights.int8_rows`) quantizes each layer
through temporaries that the C allocator keeps once freed (40-130 MB over Qwen2.5 0.5B's
layers, varying from one start to the next); :func:`kvboost_rag.c_heap.trim` hands such free memory
back (glibc's ``malloc_trim``; nothing elsewhere).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

logger = logging.getLogger(__name__)

#: ``madvise`` advice: reclaim these pages now (Linux 5.4+).
MADV_PAGEOUT = 21
#: Tensors smaller than this are left alone (a few pages are not worth a system call).
MIN_BYTES = 16 * 2**20


def page_out(tensor: torch.Tensor) -> int:
    """Ask the kernel to reclaim the whole pages of a CPU tensor's memory.

    Args:
        tensor: Any tensor; only a contiguous CPU tensor of at least :data:`MIN_BYTES` on Linux
            is advised.

    Returns:
        The bytes advised (0 when nothing was: another device or system, a small tensor, or
        ``madvise`` refused, as kernels before 5.4 do).
    """
    if sys.platform != "linux" or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    size = tensor.numel() * tensor.element_size()
    if size < MIN_BYTES:
        return 0
    page = mmap.PAGESIZE
    start = (tensor.data_ptr() + page - 1) // page * page
    stop = (tensor.data_ptr() + size) // page * page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, stop - start, MADV_PAGEOUT) != 0:
        logger.debug("madvise(MADV_PAGEOUT) refused (errno %d)", ctypes.get_errno())
        return 0
    return stop - start


def page_out_input_embeddings(model: torch.nn.Module) -> int:
    """:func:`page_out` of the model's input embedding table, unless the output layer shares it
    (then every decode step reads it whole anyway).

    Returns:
        The bytes advised.
    """
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if not _plain(weight):  # absent, or a quantized table (torchao) whose values are its inner tensors
        return 0
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_weight = getattr(output, "weight", None)
    if _plain(output_weight) and output_weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return 0
    with torch.no_grad():
        return page_out(weight.detach())


def _plain(tensor: object) -> bool:
    """Whether ``tensor`` is a tensor with storage of its own (not a subclass wrapping others)."""
    return isinstance(tensor, torch.Tensor) and not is_traceable_wrapper_subclass(tensor)
