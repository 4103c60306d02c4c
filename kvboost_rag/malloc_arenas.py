"""How many heaps (arenas) the C allocator may keep: less resident memory under a steady load.

glibc's ``malloc`` gives each thread that allocates an arena of its own, up to eight per CPU,
and keeps what is freed in each arena for that arena's next requests. A server's threads (the
HTTP server's workers, callers' threads, the engine's helpers and the model load's) each
allocate a request's small and middle-sized buffers (token lists, sampling state, tensors
below the mmap threshold) in their own arena, and the free space each arena keeps is held
apart from the others'.

Measured with ``bench/fault_soak.py`` in its steady mode (12 clients at once sending the same
12 RAG requests of 4 documents every round, nothing new stored, 10 rounds; the embedded model,
2 threads, a 2-core AMD EPYC VM), resident memory over rounds 2-10:

================================  ======================  =========================
arenas                            mean of rounds 2-10      round 2 -> round 10
================================  ======================  =========================
glibc's default (2 runs)          2,758 and 2,704 MiB      1.056x and 0.993x
capped at 2 (3 runs)              2,673, 2,529, 2,389 MiB  1.004x, 1.004x, 1.031x
================================  ======================  =========================

About 200 MiB (7%) less on average, rounds no slower (their mean 14.7-18.6 s against
16.8-19.4 s); the swings between rounds (up to 4%) remain with either. Answers were equal to
their one-at-a-time answers in every run.

:func:`limit_malloc_arenas` caps them (``mallopt(M_ARENA_MAX)``): threads that allocate for the
first time after it share the capped arenas. Only glibc is handled (other C libraries and
platforms are left as they are), and a ``MALLOC_ARENA_MAX`` set in the environment wins: glibc
read it at start and the engine does not override it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

#: ``mallopt`` parameter of glibc: the most arenas the allocator may create.
M_ARENA_MAX = -8
#: The environment variable glibc reads at start for the same cap.
ARENA_ENV = "MALLOC_ARENA_MAX"


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc, else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc defines it (musl does not)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def limit_malloc_arenas(count: int) -> bool:
    """Cap the C allocator's arenas at ``count`` for the whole process (glibc only).

    Args:
        count: Most arenas; threads that allocate for the first time afterwards share them.

    Returns:
        Whether the cap was set: ``False`` where the C library is not glibc, or where
        ``MALLOC_ARENA_MAX`` is set in the environment (the user's choice stands).

    Raises:
        ValueError: If ``count`` is below 1.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if os.environ.get(ARENA_ENV):
        return False
    libc = _glibc()
    if libc is None:
        return False
    done = bool(libc.mallopt(M_ARENA_MAX, count))
    logger.debug("malloc arenas capped at %d: %s", count, done)
    return done
