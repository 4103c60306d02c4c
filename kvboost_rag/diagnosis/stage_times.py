"""Wall time of each prefill stage, for benchmarks and diagnosis.

A call marks its stages (tokenize, plan, lookup, stitch, probe, select, blend, ...) with :func:`stage`; a
caller that wants the times wraps a call in :func:`record_stages` and reads the yielded
dict. Work another thread runs for the call (its prompt work in the engine loop) records into
the same dict (:func:`current`, :func:`recording_into`); a stage whose block spans a pass the
loop runs counts the pass (and whatever else the loop ran meanwhile: time one call at a time). Outside :func:`record_stages` a stage costs one thread-local read and nothing is
recorded. A stage's time excludes the stages nested in it. On CUDA the device is synchronized at each stage boundary while recording, so the
times are the work's and not the launch's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

#: The dict the calling thread records its stages into: stages are marked deep in the
#: prefill, where threading a recorder through every call would burden every signature for
#: a diagnosis; thread-local so that concurrent calls record apart.
_state = threading.local()


@contextlib.contextmanager
def record_stages(synchronize: bool = True) -> Iterator[dict[str, float]]:
    """Within the block (this thread), prefill stages add their wall time to the yielded dict.

    Args:
        synchronize: Synchronize a CUDA device at each stage boundary, so each stage's time is
            its work's; ``False`` leaves the device's queue alone (the times are then the host's
            only, for a call timed as a whole).

    Yields:
        Stage name -> milliseconds, summed over the stage's occurrences.
    """
    previous = getattr(_state, "times", None), getattr(_state, "nested", None), getattr(_state, "sync", True)
    times: dict[str, float] = {}
    _state.times, _state.nested, _state.sync = times, [0.0], synchronize
    try:
        yield times
    finally:
        _state.times, _state.nested, _state.sync = previous


Recording = tuple[dict[str, float], list[float], bool]


def current() -> Recording | None:
    """What this thread records stages into (``None``: nothing), for work another thread runs
    on its behalf."""
    times = getattr(_state, "times", None)
    return None if times is None else (times, _state.nested, _state.sync)


@contextlib.contextmanager
def recording_into(recording: Recording | None) -> Iterator[None]:
    """Within the block, stages on this thread record into ``recording`` (from
    :func:`current` on another thread; ``None``: nothing is recorded)."""
    previous = getattr(_state, "times", None), getattr(_state, "nested", None), getattr(_state, "sync", True)
    _state.times, _state.nested, _state.sync = recording if recording is not None else (None, None, True)
    try:
        yield
    finally:
        _state.times, _state.nested, _state.sync = previous


@contextlib.contextmanager
def stage(name: str, device: torch.device | None = None) -> Iterator[None]:
    """Time the block as stage ``name`` when :func:`record_stages` is active.

    Args:
        name: The stage.
        device: The model's device; a CUDA device is synchronized before and after.
    """
    times: dict[str, float] | None = getattr(_state, "times", None)
    if times is None:
        yield
        return
    cuda = device is not None and device.type == "cuda" and _state.sync
    if cuda:
        torch.cuda.synchronize(device)
    nested: list[float] = _state.nested  # milliseconds spent in the stages inside each open stage
    nested.append(0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - start) * 1000
        inner = nested.pop()
        nested[-1] += elapsed
        times[name] = times.get(name, 0.0) + elapsed - inner
