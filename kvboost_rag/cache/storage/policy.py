"""Eviction policy, kept apart from the bytes it evicts.

:class:`FrequencyRecencyPolicy` scores each key by how often it was used, decayed by how long
ago: ``score = hits * 0.5 ** (age / half_life)`` where age counts accesses to the whole
policy since the key's last use. Frequently used documents survive a burst of one-off
documents (pure LRU would drop them), and stale popular entries still age out. Pinned keys are
never offered as victims. :meth:`FrequencyRecencyPolicy.rank` also says whether a key was ever
used after it was stored, so a tier can evict entries nobody reused (one-off prompts' prefix
chunks) before anything else.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class FrequencyRecencyPolicy:
    """Chooses eviction victims by decayed use frequency.

    Args:
        half_life: Accesses after which a key's past hits count half.
    """

    def __init__(self, half_life: int = 256) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self._half_life = half_life
        self._clock = 0
        self._hits: dict[str, float] = {}
        self._last: dict[str, int] = {}
        self._pinned: set[str] = set()
        self._reused: set[str] = set()
        self._lock = threading.Lock()

    def insert(self, key: str) -> None:
        """Record a newly stored key (counts as one use); a pin on it is kept."""
        with self._lock:
            self._clock += 1
            self._hits[key] = self._decayed(key) + 1.0
            self._last[key] = self._clock

    def pin(self, key: str) -> bool:
        """Never offer ``key`` as a victim. Returns whether the key is known."""
        with self._lock:
            if key not in self._hits:
                return False
            self._pinned.add(key)
            return True

    def unpin(self, key: str) -> None:
        """Let ``key`` be evicted again."""
        with self._lock:
            self._pinned.discard(key)

    def oldest_pinned(self, candidates: Iterable[str]) -> str | None:
        """The pinned key among ``candidates`` used least recently, if any."""
        with self._lock:
            pinned = [(self._last.get(k, 0), k) for k in candidates if k in self._pinned]
        return min(pinned)[1] if pinned else None

    def touch(self, key: str) -> None:
        """Record one use of ``key`` (a cache hit)."""
        with self._lock:
            if key not in self._hits:
                return
            self._clock += 1
            self._hits[key] = self._decayed(key) + 1.0
            self._last[key] = self._clock
            self._reused.add(key)

    def remove(self, key: str) -> None:
        """Forget ``key``."""
        with self._lock:
            self._hits.pop(key, None)
            self._last.pop(key, None)
            self._pinned.discard(key)
            self._reused.discard(key)

    def is_pinned(self, key: str) -> bool:
        """Whether ``key`` is pinned."""
        return key in self._pinned

    def rank(self, key: str) -> tuple[float, int, bool]:
        """``(decayed score, last use, reused since stored)`` of ``key`` (zeros when unknown)."""
        with self._lock:
            return self._decayed(key), self._last.get(key, 0), key in self._reused

    def victims(self, candidates: Iterable[str] | None = None) -> list[str]:
        """Unpinned keys ordered from first to evict to last.

        Args:
            candidates: Restrict to these keys (default: every known key).
        """
        with self._lock:
            keys = self._hits.keys() if candidates is None else candidates
            scored = [(self._decayed(k), self._last.get(k, 0), k) for k in keys if k not in self._pinned]
        scored.sort()
        return [k for _, _, k in scored]

    def _decayed(self, key: str) -> float:
        hits = self._hits.get(key)
        if hits is None:
            return 0.0
        age = self._clock - self._last[key]
        return hits * 0.5 ** (age / self._half_life)
