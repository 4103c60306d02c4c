"""The C heap's free memory, handed back to the system.

Torch's CPU tensors come from the C allocator (glibc's ``malloc`` on Linux). A forward pass
allocates and frees its temporaries (activations, attention scores, logits: up to tens of MB
each, of sizes that change with every prompt); once freed, glibc keeps much of that memory in
its heaps, one per thread that allocated (the engine loop, the write-back's workers, the
server's request threads), fragmented between the blocks still in use, for the next
allocation. Under a steady load nothing the engine holds grows, yet resident memory creeps up
as those heaps do. :func:`trim` hands their free pages back (``malloc_trim(0)``: every heap,
free pages in the middle of them too, since glibc 2.8). It costs a walk of the heaps (a few ms)
and the next allocations fault their pages in again, so the engine calls it only where memory
has just been let go and nothing waits: after the weight copies are made at load, and when the
engine loop's thread ends after its idle linger.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where there is none."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return the C heaps' free memory to the system.

    Returns:
        Whether any memory was returned (``False`` where there is no glibc).
    """
    malloc_trim = _malloc_trim()
    return malloc_trim is not None and bool(malloc_trim(0))
