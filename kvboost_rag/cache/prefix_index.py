"""The in-process index of stored prefix chunks by parent key.

Grid chunks are found by hash alone; this index finds the last, shorter piece of a prefix hit
(a stored chunk whose leading tokens match, or a short chunk written off the grid) among the
children of the last grid key that hit. Each entry describes one stored chunk and leaves with
it: the cache drops it when no tier holds the chunk any more, and its bytes count against the
memory budget (:attr:`PrefixIndex.nbytes`).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Sequence

#: Estimated bytes of one entry besides its tokens (two dict slots, two key strings, the array).
ENTRY_OVERHEAD_BYTES = 2 * (sys.getsizeof("0" * 64) + 48) + sys.getsizeof(array("l"))


class PrefixIndex:
    """Parent prefix key -> stored child chunks (their keys and tokens)."""

    def __init__(self) -> None:
        self._children: dict[str, dict[str, array]] = {}
        self._parent_of: dict[str, str] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._parent_of)

    @property
    def nbytes(self) -> int:
        """Estimated bytes held."""
        with self._lock:
            return self._bytes

    def keys(self) -> list[str]:
        """Keys of the indexed chunks."""
        with self._lock:
            return list(self._parent_of)

    def add(self, parent: str, key: str, tokens: Sequence[int]) -> None:
        """Index the stored chunk ``key`` (holding ``tokens``) under ``parent``."""
        with self._lock:
            if key in self._parent_of:
                return
            packed = array("l", tokens)
            self._children.setdefault(parent, {})[key] = packed
            self._parent_of[key] = parent
            self._bytes += ENTRY_OVERHEAD_BYTES + packed.itemsize * len(packed)

    def children(self, parent: str) -> list[tuple[str, array]]:
        """``(key, tokens)`` of the chunks indexed under ``parent``."""
        with self._lock:
            return list(self._children.get(parent, {}).items())

    def drop(self, key: str) -> None:
        """Forget the chunk ``key`` (no tier holds it)."""
        with self._lock:
            parent = self._parent_of.pop(key, None)
            if parent is None:
                return
            siblings = self._children[parent]
            packed = siblings.pop(key)
            self._bytes -= ENTRY_OVERHEAD_BYTES + packed.itemsize * len(packed)
            if not siblings:
                del self._children[parent]

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._children.clear()
            self._parent_of.clear()
            self._bytes = 0
