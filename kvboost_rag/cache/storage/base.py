"""What a storage tier stores and the interface every tier implements.

Tiers know tensors and bytes, never models: an entry is a flat ``dict[str, Tensor]`` plus
string metadata (:class:`StoredEntry`). Turning K/V into a stored entry and back (and
quantizing on the way) is the codec's job (:mod:`kvboost_rag.cache.codec`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvboost_rag.host_memory.counted_hold import CountedHold

#: Metadata field naming what an entry that describes rather than holds K/V is (a document
#: record: ``"document"``). Such entries are host metadata: a tier in device memory never holds
#: them, whatever their tensors.
KIND_FIELD = "kind"
#: Tensors of a K/V entry that the host reads (token ids, compared with prompt tokens): they
#: stay in host memory when the entry's K/V goes to a device.
HOST_TENSORS = frozenset({"token_ids"})


class TierWriteError(RuntimeError):
    """A tier failed to take an entry (the other tiers were still offered it); the message
    names the tier's error. Raised without the tier's exception attached, so that no
    traceback keeps the entry's memory alive."""


@dataclass(frozen=True)
class StoredEntry:
    """One cache entry as tiers hold it.

    Attributes:
        tensors: Named tensors (for example ``keys``, ``values``, ``token_ids``).
        metadata: String metadata (codec name, start position, fingerprint, ...).
    """

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def host_only(self) -> bool:
        """Whether the entry is host metadata (it names a :data:`KIND_FIELD`), never placed
        in device memory."""
        return KIND_FIELD in self.metadata


class CopyUnderWay:
    """The write-back's copies of a job's lent chunks into memory the cache owns, each staged
    in place of its view as soon as it is made: *started* once the copier took the job,
    *finished* once every copy is staged (or the job failed and unstaged the views). A lookup
    that finds a view whose job is under way waits for that chunk's copy and reads it rather
    than making one of its own (the same bytes copied twice on the same cores, into memory
    touched for the first time), as long as the copier keeps staging copies: the copier runs
    at a lower priority, and beside the engine loop's passes it may stage none for a while."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._started = False
        self._finished = False
        self._staged = 0  # copies staged so far
        self._stalled = False  # a waiter saw no progress: later lookups copy for themselves at once

    def start(self) -> None:
        """The copier began the job."""
        with self._changed:
            self._started = True

    def advance(self) -> None:
        """One more chunk's copy is staged: waiters look again."""
        with self._changed:
            self._staged += 1
            self._changed.notify_all()

    def finish(self) -> None:
        """Every copy is staged, or the views unstaged (a failed job): waiters go on."""
        with self._changed:
            self._started = self._finished = True
            self._changed.notify_all()

    def wait_if_started(self, done: Callable[[], bool], stall_seconds: float) -> bool:
        """When the job has started (not while it is queued), wait until ``done()`` holds
        (looked at as each copy is staged) or the job finished, unless no copy is staged for
        ``stall_seconds``; whether ``done()`` holds. Once a wait saw no progress, later ones do
        not wait."""
        with self._changed:
            if not self._started or self._stalled:
                return False
            while not (self._finished or done()):
                staged = self._staged
                if not self._changed.wait_for(lambda: self._finished or self._staged != staged, stall_seconds):
                    self._stalled = True
                    return False
            return done()


@dataclass(frozen=True)
class LentEntry(StoredEntry):
    """A staged entry whose tensors view memory lent to a request (its K/V buffers, until the
    write-back has copied them): a lookup reads the write-back's copy once its job is under
    way (``copy``), else a copy of its own, made while it holds ``hold``
    (:meth:`~kvboost_rag.cache.storage.TieredStore.fetch`), so no view of the lent memory
    outlives the hold.

    Attributes:
        hold: The hold on the lent memory (the write-back's job owns its first reference).
        copy: The write-back's copies of the job's chunks, staged one by one once the
            copier runs it.
    """

    hold: CountedHold | None = None
    copy: CopyUnderWay | None = None

    def copied(self) -> StoredEntry | None:
        """A copy in memory of its own, made under a reference on :attr:`hold`; ``None`` when
        the lent memory already went back (nothing to read)."""
        if self.hold is None or not self.hold.acquire():
            return None
        try:
            tensors = {name: t if name in HOST_TENSORS else t.clone() for name, t in self.tensors.items()}
            return StoredEntry(tensors, dict(self.metadata))  # token ids are the entry's own, not lent
        finally:
            self.hold.release()


class StorageTier(ABC):
    """A key -> :class:`StoredEntry` store with its own capacity rules.

    Implementations must be safe to call from several threads. ``get`` returns ``None`` for a
    missing, corrupt or unreadable entry: a broken entry is a miss, never an exception.
    """

    name: str = "tier"
    #: An overflow tier: the store writes to it only what the tier above evicts (a spill),
    #: instead of every entry (write-through).
    spill_only: bool = False

    @abstractmethod
    def get(self, key: str) -> StoredEntry | None:
        """Return the entry stored under ``key``, or ``None``."""

    @abstractmethod
    def put(self, key: str, entry: StoredEntry) -> list[str]:
        """Store ``entry`` under ``key`` (a pin on ``key`` is kept).

        Args:
            key: Hex cache key.
            entry: What to store.

        Returns:
            The keys evicted to make room.
        """

    def pin(self, key: str) -> bool:
        """Keep ``key`` resident: eviction skips it until :meth:`unpin`. Writes nothing.

        Tiers without eviction of their own (Redis: the server decides) ignore pins.

        Returns:
            Whether this tier holds ``key`` and pinned it.
        """
        return False

    def unpin(self, key: str) -> None:  # noqa: B027 - optional hook
        """Let ``key`` be evicted again (no-op where pins are ignored)."""

    def put_many(self, items: list[tuple[str, StoredEntry]]) -> list[str]:
        """Store several entries (tiers that can move them together override this).

        Returns:
            The keys evicted to make room.
        """
        evicted: list[str] = []
        for key, entry in items:
            evicted += self.put(key, entry)
        return evicted

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored (without loading it)."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Iterate over stored keys."""

    def keys_with_prefix(self, prefix: str) -> Iterator[str]:
        """Iterate over stored keys that start with ``prefix`` (tiers that can filter on
        the server or in a listing override this)."""
        return iter([key for key in self.keys() if key.startswith(prefix)])

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently held."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles (no-op by default)."""
