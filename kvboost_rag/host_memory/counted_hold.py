"""A counted hold on memory someone else lent: it goes back when the last holder lets go.

A finished prompt's K/V stays in its lent buffers (on a CPU) until the write-back has copied
what it stores; meanwhile views of those buffers are staged in the tier stack, and a request
that looks such a chunk up copies it out. The write-back's job holds the buffers from the
start; a lookup holds them only while it copies (:meth:`CountedHold.acquire` refuses once the
buffers went back). The buffers go back, by name, when the last holder releases them: no view's
lifetime and no collector decides it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class CountedHold:
    """References on lent memory: one for its first holder, one more per :meth:`acquire`.

    Args:
        on_released: Gives the memory back; called once, by whoever releases the last
            reference (on that thread, without the hold's lock).
    """

    def __init__(self, on_released: Callable[[], None]) -> None:
        self._on_released = on_released
        self._references = 1
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether any reference is left (the memory has not gone back)."""
        with self._lock:
            return self._references > 0

    def acquire(self) -> bool:
        """Take one more reference; ``False`` (nothing taken) once the memory went back."""
        with self._lock:
            if self._references == 0:
                return False
            self._references += 1
            return True

    def release(self) -> None:
        """Let go of one reference; the last one gives the memory back.

        Raises:
            RuntimeError: More releases than references (a holder released twice).
        """
        with self._lock:
            if self._references == 0:
                raise RuntimeError("a counted hold was released more often than it was taken")
            self._references -= 1
            last = self._references == 0
        if last:
            self._on_released()
