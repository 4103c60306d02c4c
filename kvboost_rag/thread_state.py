"""Scoped thread-local settings: a value set for the length of a block, on this thread only.

Used where a pass must hand a parameter to code that transformers calls with its own
arguments (an attention function, a module's ``forward``): each module keeps its own
``threading.local`` and says there why it is one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def thread_setting(state: threading.local, name: str, value: object) -> Iterator[None]:
    """Set ``state.<name>`` to ``value`` within the block (this thread), then restore it."""
    previous = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield
    finally:
        setattr(state, name, previous)
