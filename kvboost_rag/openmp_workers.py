"""Idle OpenMP workers given back, so the engine loop's workers keep spinning between regions.

Torch's CPU kernels split their work over GNU OpenMP (libgomp) teams; each thread that runs a
parallel region keeps its own pool of worker threads for the next one. Between regions a
team's workers spin for a while before they sleep, which is what makes a decode step's few
hundred short regions cheap. libgomp cuts that spinning to almost nothing once the threads of
all pools together outnumber the CPUs it may use: then every region waits for sleeping workers
to be woken. A process whose caller thread loaded the model (its pool) and whose engine loop
decodes (the loop's pool) has ``2 * threads - 1`` such threads, more than the CPUs wherever
torch uses more than half of them (a 2-core machine at 2 threads: 3 on 2 CPUs). Measured
there on Qwen2.5 0.5B's one-token decode step, interleaved rounds of the same step: on a
second thread 1.19x the time it took on the thread that loaded the model, 0.97x once that
thread's idle pool was given back.

:func:`release_idle_workers` gives the calling thread's pool back (OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)``; libgomp releases only the caller's pool and builds
it anew the next time that thread runs a parallel region). The engine calls it on the threads
that hand work to the loop and on its own helper threads before they wait. Only libgomp is
handled: in LLVM's and Intel's runtimes the call pauses the whole runtime, every thread's
pools, so it is not made there.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

import torch  # noqa: F401 - loads the OpenMP runtime this module looks for

logger = logging.getLogger(__name__)

#: ``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``.
OMP_PAUSE_SOFT = 1
#: File names of GNU OpenMP runtimes (torch's Linux wheels ship ``libgomp.so.1``).
GNU_OPENMP_PREFIX = "libgomp"


def loaded_gnu_openmp(maps: str = "/proc/self/maps") -> str | None:
    """The path of the GNU OpenMP runtime this process has loaded (``None``: none, or no
    ``/proc``)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(GNU_OPENMP_PREFIX) and ".so" in path:
                    return path
    except OSError:
        return None
    return None


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` (``None`` where it is not loaded or lacks it)."""
    path = loaded_gnu_openmp()
    if path is None:
        return None
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        logger.debug("no omp_pause_resource_all in %s", path)
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause


def release_idle_workers() -> bool:
    """Give back the calling thread's OpenMP worker pool (see the module's doc).

    Call it only from a thread that is not inside a parallel region (any Python code outside a
    torch kernel's callback). Where the runtime is not libgomp, does nothing.

    Returns:
        Whether libgomp accepted the call (``True`` also when the thread had no pool).
    """
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
