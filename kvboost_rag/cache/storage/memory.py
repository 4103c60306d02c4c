"""In-memory tier with a byte budget and frequency+recency eviction of whole groups.

Entries may belong to a *group* (a document: its record and its K/V chunks), named by a
``group_of(key)`` function the owner of the tier sets (:attr:`MemoryTier.group_of`); an entry
with no group is a group of its own. Eviction removes whole groups, in this order:

1. groups of one entry that nobody used after it was stored (a one-off prompt's prefix chunk);
2. then every other group by its best member's decayed use frequency, least recent first.

Groups holding a pinned entry are never offered; the entry being stored never evicts its own
group. Evicted entries are handed to :attr:`MemoryTier.on_evict` (when set) before ``put``
returns, so a store can spill them to a slower tier; one-off entries (class 1) are not handed
over: a prefix no prompt reused is not worth a disk write, and spilling every one-off prompt
would fill the slower tier and push the documents out of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from kvboost_rag.cache.storage.base import StorageTier, StoredEntry
from kvboost_rag.cache.storage.policy import FrequencyRecencyPolicy
from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: An evicted entry: its key, the entry, and whether it was a one-off (not handed over).
_Evicted = tuple[str, StoredEntry, bool]


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
        self._group: dict[str, str] = {}
        self._members: dict[str, set[str]] = {}
        self._lock = threading.RLock()
        #: Names the group of a key (``None``: the key is a group of its own).
        self.group_of: Callable[[str], str | None] | None = None
        #: Receives the evicted ``(key, entry)`` pairs worth keeping (all but one-off entries)
        #: before ``put``/``reserve`` returns.
        self.on_evict: Callable[[list[tuple[str, StoredEntry]]], None] | None = None

    def get(self, key: str) -> StoredEntry | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is not None:
            self.policy.touch(key)
        return entry

    def group_entries(self, key: str) -> list[tuple[str, StoredEntry]]:
        """The other entries of ``key``'s group held here (no use is counted)."""
        with self._lock:
            group = self._group.get(key)
            members = self._members.get(group, ()) if group is not None else ()
            return [(other, self._entries[other]) for other in members if other != key and other in self._entries]

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        size = entry.nbytes
        room = self.max_bytes - self.reserved_bytes
        if size > room:
            _warnings.warning(
                "too-large", "entry %s (%d bytes) exceeds the memory budget left (%d); not stored", key[:12], size, room
            )
            return []
        evicted: list[_Evicted] = []
        group = self._group_name(key)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.nbytes
                self._leave_group(key)
            self._make_room(size, evicted, protect=group)
            self._entries[key] = entry
            self._used += size
            self._join_group(key, group)
            self.policy.insert(key)
        return self._hand_over(evicted)

    def reserve(self, owner: str, nbytes: int) -> list[str]:
        """Count ``nbytes`` held by ``owner`` outside the tier against the budget.

        Replaces ``owner``'s previous reservation. Entries are evicted (unpinned first) until
        entries and reservations fit the budget again.

        Returns:
            The keys evicted.
        """
        evicted: list[_Evicted] = []
        with self._lock:
            self._reserved[owner] = max(0, nbytes)
            self._make_room(0, evicted)
        return self._hand_over(evicted)

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by owners outside the tier."""
        with self._lock:
            return sum(self._reserved.values())

    def _group_name(self, key: str) -> str:
        group = self.group_of(key) if self.group_of is not None else None
        return group if group is not None else key

    def _join_group(self, key: str, group: str) -> None:
        self._group[key] = group
        self._members.setdefault(group, set()).add(key)

    def _leave_group(self, key: str) -> None:
        group = self._group.pop(key, None)
        if group is None:
            return
        members = self._members.get(group)
        if members is not None:
            members.discard(key)
            if not members:
                del self._members[group]

    def _hand_over(self, evicted: list[_Evicted]) -> list[str]:
        kept = [(key, entry) for key, entry, one_off in evicted if not one_off]
        if kept and self.on_evict is not None:
            self.on_evict(kept)
        return [key for key, _, _ in evicted]

    def victim_groups(self, protect: str | None = None) -> list[list[str]]:
        """Groups in eviction order (first to evict first), each as its member keys.

        Args:
            protect: A group never offered (the one being written).
        """
        return [members for _, members in self._ranked_groups(protect)]

    def _ranked_groups(self, protect: str | None) -> list[tuple[bool, list[str]]]:
        """``(one_off, members)`` of every unpinned group but ``protect``, first to evict first."""
        with self._lock:
            groups = [(group, list(members)) for group, members in self._members.items() if group != protect]
        ranked = []
        for group, members in groups:
            if any(self.policy.is_pinned(key) for key in members):
                continue
            ranks = [self.policy.rank(key) for key in members]
            one_off = len(members) == 1 and group == members[0] and not ranks[0][2]
            ranked.append((not one_off, max(r[0] for r in ranks), max(r[1] for r in ranks), group, members))
        ranked.sort(key=lambda item: item[:4])
        return [(not later, members) for later, *_, members in ranked]

    def _make_room(self, size: int, evicted: list[_Evicted], protect: str | None = None) -> None:
        """Evict whole groups until ``size`` more bytes fit beside the entries and reservations."""
        limit = self.max_bytes - sum(self._reserved.values())
        if self._used + size > limit:
            for one_off, members in self._ranked_groups(protect):
                if self._used + size <= limit:
                    break
                for victim in members:
                    self._evict(victim, evicted, one_off)
        if self._used + size > limit and protect is not None:
            # The group being written does not fit beside the pins: it cannot stay whole here.
            for victim in list(self._members.get(protect, ())):
                if not self.policy.is_pinned(victim):
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

    def _evict(self, victim: str, evicted: list[_Evicted], one_off: bool = False) -> None:
        entry = self._entries.pop(victim)
        self._used -= entry.nbytes
        self.policy.remove(victim)
        self._leave_group(victim)
        evicted.append((victim, entry, one_off))

    def delete(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._used -= entry.nbytes
                self.policy.remove(key)
                self._leave_group(key)

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
            self._group.clear()
            self._members.clear()
            self._used = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries plus the reservations."""
        with self._lock:
            return self._used + sum(self._reserved.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
