"""In-memory tier with a byte budget and frequency+recency eviction."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.storage.base import StorageTier, StoredEntry
from kvboost_rag.storage.policy import FrequencyRecencyPolicy

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)


class MemoryTier(StorageTier):
    """Entries held as tensors in process memory.

    Besides entries, the budget covers bytes that owners *reserve* for what they hold outside
    the tier (the cache's indexes, see :meth:`reserve`); ``used_bytes`` counts both.

    Args:
        max_bytes: Byte budget. Unpinned entries are evicted (lowest decayed frequency first)
            to stay within it; an entry larger than the room left by reservations is not stored.
        policy: Eviction policy (a fresh :class:`FrequencyRecencyPolicy` by default).
    """

    name = "memory"

    def __init__(self, max_bytes: int, policy: FrequencyRecencyPolicy | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.policy = policy or FrequencyRecencyPolicy()
        self._entries: dict[str, StoredEntry] = {}
        self._used = 0
        self._reserved: dict[str, int] = {}
        self._lock = threading.RLock()

    def get(self, key: str) -> StoredEntry | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            self.policy.touch(key)
        return entry

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        size = entry.nbytes
        room = self.max_bytes - self.reserved_bytes
        if size > room:
            _warnings.warning(
                "too-large", "entry %s (%d bytes) exceeds the memory budget left (%d); not stored", key[:12], size, room
            )
            return []
        evicted: list[str] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.nbytes
            self._make_room(size, evicted)
            self._entries[key] = entry
            self._used += size
            self.policy.insert(key)
        return evicted

    def reserve(self, owner: str, nbytes: int) -> list[str]:
        """Count ``nbytes`` held by ``owner`` outside the tier against the budget.

        Replaces ``owner``'s previous reservation. Entries are evicted (unpinned first) until
        entries and reservations fit the budget again.

        Returns:
            The keys evicted.
        """
        evicted: list[str] = []
        with self._lock:
            self._reserved[owner] = max(0, nbytes)
            self._make_room(0, evicted)
        return evicted

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by owners outside the tier."""
        with self._lock:
            return sum(self._reserved.values())

    def _make_room(self, size: int, evicted: list[str]) -> None:
        """Evict until ``size`` more bytes fit beside the entries and reservations."""
        limit = self.max_bytes - sum(self._reserved.values())
        if self._used + size > limit:
            for victim in self.policy.victims(list(self._entries)):
                if self._used + size <= limit:
                    break
                self._evict(victim, evicted)
        while self._used + size > limit and self._entries:
            # Only pinned entries are left: the pin used least recently gives way, so
            # the newest shared beginnings stay served instead of nothing new being stored.
            victim = self.policy.oldest_pinned(list(self._entries))
            if victim is None:
                break
            _warnings.warning(
                "pins-full",
                "memory tier full of pinned entries (max_cache_bytes=%d): evicting the least recently "
                "used pin; raise max_cache_bytes or warm fewer shared beginnings",
                self.max_bytes,
            )
            self._evict(victim, evicted)

    def pin(self, key: str) -> bool:
        with self._lock:
            return key in self._entries and self.policy.pin(key)

    def unpin(self, key: str) -> None:
        self.policy.unpin(key)

    def _evict(self, victim: str, evicted: list[str]) -> None:
        self._used -= self._entries.pop(victim).nbytes
        self.policy.remove(victim)
        evicted.append(victim)

    def delete(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
                self.policy.remove(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self.policy.remove(key)
            self._entries.clear()
            self._used = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries plus the reservations."""
        with self._lock:
            return self._used + sum(self._reserved.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
