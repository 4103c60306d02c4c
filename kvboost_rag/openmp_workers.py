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


def loaded_gnu_openmp(maps: str = "/proc/self/maps") -> list[str]:
    """The paths of the GNU OpenMP runtimes this process has loaded, in the order they are
    mapped (torch's own, and any other a library brought: each keeps its own pools; empty
    where there is none, or no ``/proc``)."""
    found: list[str] = []
    try:
        with open(maps, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith(GNU_OPENMP_PREFIX) and ".so" in path and path not in found:
                    found.append(path)
    except OSError:
        return []
    return found


@functools.cache
def _pauses() -> tuple[Callable[[int], int], ...]:
    """Each loaded libgomp's ``omp_pause_resource_all`` (those that have it)."""
    pauses = []
    for path in loaded_gnu_openmp():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            logger.debug("no omp_pause_resource_all in %s", path)
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        pauses.append(pause)
    return tuple(pauses)


def release_idle_workers() -> bool:
    """Give back the calling thread's OpenMP worker pools (see the module's doc), in every GNU
    OpenMP runtime loaded: which one torch's kernels use is not known by name, and in the
    others the call only releases pools of this thread that sit idle.

    Call it only from a thread that is not inside a parallel region (any Python code outside a
    torch kernel's callback). Where no runtime is libgomp, does nothing.

    Returns:
        Whether a libgomp was found and every one accepted the call (``True`` also when the
        thread had no pool).
    """
    pauses = _pauses()
    return bool(pauses) and all([pause(OMP_PAUSE_SOFT) == 0 for pause in pauses])
