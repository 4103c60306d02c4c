"""A stack of storage tiers: lookups go down the stack and promote hits upward, writes go
through to every tier except overflow tiers (``spill_only``), which receive what the memory
tier above them evicts: a memory eviction is then a demotion, not a loss.

Listeners (:meth:`TieredStore.on_gone`) hear of keys that left the whole stack (evicted from
the last tier holding them, or deleted), so what describes an entry can leave with it.

Entries on their way to the tiers (the write-back queues them for a worker thread) are
*staged* (:meth:`TieredStore.stage`): lookups and membership tests see them at once, as if a
tier above every other held them, until the worker has put them into the tiers and settled
them (:meth:`TieredStore.settle`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

from kvboost_rag.cache.storage.base import LentEntry, StorageTier, StoredEntry, TierWriteError
from kvboost_rag.cache.storage.device import DeviceTier
from kvboost_rag.cache.storage.memory import MemoryTier
from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

_T = TypeVar("_T")

#: Seconds without a copy staged after which a lookup waiting for the write-back's copy of a
#: lent chunk stops waiting and copies the view itself, as do later lookups of the job's chunks.
#: A chunk's copy takes a few ms on an idle CPU (128 tokens of a 135M model: 6 MB); beside
#: the engine loop's passes the copier, at a lower priority, may take far longer.
COPY_STALL_SECONDS = 0.05


def _unless_it_fails(tier: StorageTier, what: str, call: Callable[..., _T], *args: object) -> _T | None:
    """``call(*args)``, or ``None`` when it raises: a tier that fails to read, to take a
    promoted or spilled entry, or to delete, is passed over (a miss), logged (rate-limited),
    never a failed request."""
    try:
        return call(*args)
    except Exception as error:  # noqa: BLE001 - any tier's failure on the read path is a miss
        _warnings.warning(
            f"tier-{tier.name}-{what}-failed", "the %s tier failed a %s (%s: %s); passed over", tier.name, what,
            type(error).__name__, str(error),
        )
        return None


class TieredStore:
    """Memory first, then slower tiers.

    Args:
        tiers: Fastest first (memory, disk, Redis). The first tier is where hits are promoted.
    """

    def __init__(self, tiers: Sequence[StorageTier]) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self._lock = threading.Lock()
        self._writes = threading.RLock()  # putting staged entries vs. deleting and clearing
        self.hits: Counter[str] = Counter()
        self.misses = 0
        self.evictions: Counter[str] = Counter()
        self._listeners: list[Callable[[str], None]] = []
        self._staged: dict[str, StoredEntry] = {}
        for depth, tier in enumerate(self.tiers):
            below = [t for t in self.tiers[depth + 1 :] if t.spill_only]
            if below and isinstance(tier, MemoryTier) and not isinstance(tier, DeviceTier):
                tier.on_evict = partial(self._spill, below)

    @property
    def memory_tier(self) -> MemoryTier:
        """The tier in host memory (under any device tier): the one ``max_cache_bytes`` bounds."""
        return next(t for t in self.tiers if isinstance(t, MemoryTier) and not isinstance(t, DeviceTier))

    def group_by(self, group_of: Callable[[str], str | None]) -> None:
        """Evict entries from the in-process tiers in groups named by ``group_of(key)``
        (``None``: the key is a group of its own); see :class:`MemoryTier`."""
        for tier in self.tiers:
            if isinstance(tier, MemoryTier):
                tier.group_of = group_of

    def _spill(self, below: list[StorageTier], evicted: list[tuple[str, StoredEntry]]) -> None:
        """Write what a memory tier evicted to the overflow tiers below it."""
        for key, entry in evicted:
            for tier in below:
                if not self.holds(tier, key):
                    self._count_evictions(tier, _unless_it_fails(tier, "put", tier.put, key, entry) or [])

    def on_gone(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(key)`` for each key no tier holds any more after an eviction or a
        delete (tiers that evict on their own, like Redis, are not heard: their misses are)."""
        self._listeners.append(listener)

    def get(self, key: str) -> StoredEntry | None:
        """Return the entry from the fastest tier holding it, promoting it to faster tiers.

        When a :class:`DeviceTier` took the promoted entry, its device copy is returned.
        """
        found = self.fetch(key)
        return None if found is None else found[0]

    def fetch(self, key: str) -> tuple[StoredEntry, bool] | None:
        """Like :meth:`get`, and whether the entry came from a tier of this process's own
        memory (memory or device tier: entries this process wrote, or read from a shared tier
        and checked then), so its values need no checking again. A staged entry is served
        first (it is this process's own; one over lent memory is served as a copy)."""
        staged = self._staged_to_read(key)
        if staged is not None:
            return staged, True
        for depth, tier in enumerate(self.tiers):
            entry = _unless_it_fails(tier, "get", tier.get, key)
            if entry is None:
                continue
            with self._lock:
                self.hits[tier.name] += 1
            served = self._promote(depth, tier, key, entry)
            return served, isinstance(tier, MemoryTier)
        with self._lock:
            self.misses += 1
        return None

    def _promote(self, depth: int, tier: StorageTier, key: str, entry: StoredEntry) -> StoredEntry:
        """Put ``entry``, found in ``tier``, into the tiers above it; what to serve (the device
        copy when a device tier took it). A tier that fails to take it is passed over."""
        served = entry
        for upper in self.tiers[:depth]:
            if isinstance(upper, DeviceTier):
                # The entry's whole group (a document's chunks) moves up with it, in one
                # copy; the device copy just made is served.
                evicted = _unless_it_fails(upper, "put", upper.put_many, self._with_group(tier, key, entry))
                self._count_evictions(upper, evicted or [])
                served = upper.resident(key) or served
            else:
                self._count_evictions(upper, _unless_it_fails(upper, "put", upper.put, key, entry) or [])
        return served

    def _with_group(self, tier: StorageTier, key: str, entry: StoredEntry) -> list[tuple[str, StoredEntry]]:
        """``(key, entry)`` and, when ``tier`` keeps groups in memory, the other members of
        the key's group it holds (without counting a use)."""
        items = [(key, entry)]
        if isinstance(tier, MemoryTier):
            items += tier.group_entries(key)
        return items

    def put(self, key: str, entry: StoredEntry, *, device: bool = True) -> None:
        """Write ``entry`` to every tier but the overflow tiers (they get it when evicted
        above); with ``device=False``, not to a device tier either (it holds the entry's
        device copy already: :meth:`put_device`).

        Raises:
            TierWriteError: A tier raised (the others still took the entry).
        """
        failures: list[str] = []
        for tier in self.tiers:
            if not tier.spill_only and (device or not isinstance(tier, DeviceTier)):
                try:
                    self._count_evictions(tier, tier.put(key, entry))
                except Exception as error:  # noqa: BLE001 - the other tiers still take it
                    failures.append(f"the {tier.name} tier: {type(error).__name__}: {error}")
        if failures:
            raise TierWriteError("; ".join(failures))

    def put_device(self, items: list[tuple[str, StoredEntry]]) -> None:
        """Hold entries whose K/V is on the device already in the device tiers (no copy);
        nothing without a device tier."""
        for tier in self.tiers:
            if isinstance(tier, DeviceTier):
                self._count_evictions(tier, tier.put_many(items))

    @property
    def has_device_tier(self) -> bool:
        """Whether a tier holds entries in device memory."""
        return any(isinstance(tier, DeviceTier) for tier in self.tiers)

    # ------------------------------------------------------------------ staged entries
    def stage(self, key: str, entry: StoredEntry) -> None:
        """Make ``entry`` visible under ``key`` before it reaches the tiers (it replaces an
        entry staged under that key before)."""
        with self._lock:
            self._staged[key] = entry

    def staged(self, key: str) -> StoredEntry | None:
        """The entry staged under ``key``, if any."""
        with self._lock:
            return self._staged.get(key)

    def _staged_to_read(self, key: str) -> StoredEntry | None:
        """The entry staged under ``key`` as a lookup may keep it. For a :class:`LentEntry` (a
        view of a request's lent buffers): the write-back's own copy when the copier has begun
        its job (waited for while it makes progress, then served as staged), else a copy made here under a reference on the
        buffers' hold; when they went back meanwhile, what is staged now is served instead."""
        while True:
            entry = self.staged(key)
            if not isinstance(entry, LentEntry):
                return entry
            if entry.copy is not None and entry.copy.wait_if_started(partial(self._unstaged, key, entry), COPY_STALL_SECONDS):
                continue  # its copy (or nothing, when the job failed or it was deleted) is staged now
            copy = entry.copied()
            if copy is not None:
                return copy
            if self.staged(key) is entry:  # buffers go back only once their views are unstaged
                raise RuntimeError(f"a staged entry outlived the lent buffers it views: {key}")

    def _unstaged(self, key: str, entry: StoredEntry) -> bool:
        """Whether ``entry`` is no longer the one staged under ``key``."""
        return self.staged(key) is not entry

    def restage(self, key: str, before: StoredEntry, after: StoredEntry) -> bool:
        """Replace the staged ``before`` with ``after`` (a copy that owns its memory); whether
        ``before`` was still the one staged (a delete or a newer stage took it away)."""
        with self._lock:
            if self._staged.get(key) is not before:
                return False
            self._staged[key] = after
            return True

    def put_staged(self, key: str, staged: StoredEntry, entry: StoredEntry, *, device: bool = True) -> bool:
        """Put ``entry`` (``staged``'s content in memory of its own, or ``staged`` itself)
        into the tiers as :meth:`put` does and settle ``staged``, unless a delete, a clear or a
        newer stage took ``staged`` away first; whether it was put. Deletes and clears wait for
        it (and it for them). When a tier raises, ``staged`` is settled all the same (what the
        tiers above took stays) and the error propagates.
        """
        with self._writes:
            if self.staged(key) is not staged:
                return False
            try:
                self.put(key, entry, device=device)
            finally:
                self.settle(key, staged)
        return True

    def settle(self, key: str, entry: StoredEntry) -> None:
        """The tiers took ``entry``: it is no longer staged (unless another replaced it)."""
        with self._lock:
            if self._staged.get(key) is entry:
                del self._staged[key]

    @property
    def staged_count(self) -> int:
        """Entries staged now."""
        with self._lock:
            return len(self._staged)

    @property
    def staged_bytes(self) -> int:
        """Bytes of the entries staged now (views of lent buffers count their rows only)."""
        with self._lock:
            return sum(entry.nbytes for entry in self._staged.values())

    def pin(self, key: str) -> bool:
        """Pin ``key`` in every tier that holds it (writes nothing); whether any did."""
        pinned = False
        for tier in self.tiers:
            pinned = tier.pin(key) or pinned
        return pinned

    def holds(self, tier: StorageTier, key: str) -> bool:
        """Whether ``tier`` holds ``key`` (a tier that fails to say does not)."""
        return bool(_unless_it_fails(tier, "contains", tier.__contains__, key))

    def contains(self, key: str) -> bool:
        """Whether ``key`` is staged or any tier holds it."""
        return self.staged(key) is not None or any(self.holds(tier, key) for tier in self.tiers)

    def delete(self, key: str) -> None:
        """Remove ``key`` from every tier (and from the staged entries); a write of it on its
        way finishes first."""
        with self._writes:
            with self._lock:
                self._staged.pop(key, None)
            for tier in self.tiers:
                _unless_it_fails(tier, "delete", tier.delete, key)  # what it keeps was computed for the key
        self._notify([key])

    def reserve(self, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` that ``owner`` holds in host memory outside the tiers against the
        memory tier's budget (never a device tier's), evicting entries to make room."""
        memory = self.memory_tier
        self._count_evictions(memory, memory.reserve(owner, nbytes))

    def keys_with_prefix(self, prefix: str) -> Iterator[str]:
        """Keys starting with ``prefix`` held by any tier (each once)."""
        seen: set[str] = set()
        for tier in self.tiers:
            for key in tier.keys_with_prefix(prefix):
                if key not in seen:
                    seen.add(key)
                    yield key

    def clear(self) -> None:
        """Remove every entry from every tier, and every staged entry; a write on its way
        finishes first (and puts nothing back after)."""
        with self._writes:
            with self._lock:
                self._staged.clear()
            for tier in self.tiers:
                tier.clear()

    def close(self) -> None:
        """Close every tier."""
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per-tier counters: hits, evictions, bytes used."""
        with self._lock:
            return {
                tier.name: {
                    "hits": self.hits[tier.name],
                    "evictions": self.evictions[tier.name],
                    "used_bytes": tier.used_bytes,
                }
                for tier in self.tiers
            }

    def _count_evictions(self, tier: StorageTier, evicted: list[str]) -> None:
        if evicted:
            with self._lock:
                self.evictions[tier.name] += len(evicted)
            logger.debug("%s tier evicted %d entries", tier.name, len(evicted))
            self._notify(evicted)

    def _notify(self, keys: list[str]) -> None:
        if not self._listeners:
            return
        for key in keys:
            if not self.contains(key):
                for listener in self._listeners:
                    listener(key)
