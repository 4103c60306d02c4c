"""What the store holds, as the host knows it: documents and prefixes. Never reads K/V.

The index is to the tiers what vLLM's block pool is to its GPU blocks: the in-process
description of every stored entry, kept within the same budget as the entries.

- Documents: the registry of their anchors (what plans look for in prompts), their records on
  the tiers (:class:`~kvboost_rag.cache.document_records.DocumentShelf`, so a fresh process over
  the same disk folder or Redis finds them), and which chunks each one owns. A document is one
  unit: the memory tier evicts its record and chunks together (:meth:`CacheIndex.group_of`
  names the groups), and when any of them leaves every tier, the rest of the document is
  deleted and the registry forgets it, so no chunk outlives its record and no record points
  at missing chunks. Documents dropped that way are counted and remembered by their anchor,
  so a prompt that holds one is told why it missed.
- Prefixes: the stored prefix chunks under each parent key
  (:class:`~kvboost_rag.cache.prefix_index.PrefixIndex`), for partial prefix hits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kvboost_rag.cache.document_records import DocumentShelf
from kvboost_rag.cache.prefix_index import PrefixIndex
from kvboost_rag.cache.storage import TieredStore
from kvboost_rag.request.documents import (
    ANCHOR_CHARS,
    DocumentRecord,
    DocumentRegistry,
    anchor_of,
)
from kvboost_rag.request.hashing import window_anchors

#: Estimated bytes of one document's entry in the ownership map, besides its chunk keys.
DOCUMENT_ENTRY_BYTES = 240
#: Estimated bytes of one chunk key in the ownership maps (key string, set, dict slots).
OWNED_CHUNK_BYTES = 360
#: Evicted documents remembered (by anchor) to explain a prompt that misses them.
MAX_EVICTED_REMEMBERED = 4096


class CacheIndex:
    """The documents and prefix chunks a tier stack holds, for one model fingerprint.

    Args:
        store: The tier stack (the index listens to what leaves it and groups its entries).
        fingerprint: Namespace of the document records.
        chunk_size: Tokens per chunk.
        on_change: Called when the index grew or shrank (the owner charges its bytes).
        on_evicted: Called once per document that left every tier.
    """

    def __init__(
        self,
        store: TieredStore,
        fingerprint: str,
        chunk_size: int,
        on_change: Callable[[], None],
        on_evicted: Callable[[], None],
    ) -> None:
        self._store = store
        self.shelf = DocumentShelf(store, fingerprint, chunk_size)
        self.prefixes = PrefixIndex()
        self._registry = DocumentRegistry(self.shelf)
        self._on_change, self._on_evicted = on_change, on_evicted
        # digest -> (anchor, chunk keys) of documents seen in this process; chunk -> digests.
        self._documents: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._owners: dict[str, set[str]] = {}
        self._owned_chunks = 0
        self._evicted: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.RLock()
        self.shelf.on_record = self.note_document
        store.group_by(self.group_of)
        store.on_gone(self._forget)

    # ------------------------------------------------------------------ documents
    def find_document(self, text: str) -> DocumentRecord | None:
        """The stored record of a document text, if any tier holds it."""
        return self._registry.lookup(text)

    def known_documents(self) -> DocumentRegistry:
        """The registry plans look for documents with (read-only use; a
        :class:`~kvboost_rag.request.plan.Planner` asks at each plan, as clearing replaces it)."""
        return self._registry

    @property
    def document_count(self) -> int:
        """Documents known (registered and stored)."""
        return len(self._registry)

    def attach_stored_documents(self) -> int:
        """Index every document record the tiers hold (written by this process or another);
        reads key names only.

        Returns:
            Documents indexed.
        """
        for anchor, digest in self.shelf.stored():
            self._registry.add_known(anchor, digest)
        self._on_change()
        return len(self._registry)

    def register(self, record: DocumentRecord) -> None:
        """Store a document's record and index it."""
        self._registry.register(record)
        self._on_change()

    @property
    def nbytes(self) -> int:
        """Estimated bytes of the in-process indexes (counted in the memory budget)."""
        with self._lock:
            owned = len(self._documents) * DOCUMENT_ENTRY_BYTES + self._owned_chunks * OWNED_CHUNK_BYTES
        return self._registry.nbytes + self.prefixes.nbytes + owned

    # ------------------------------------------------------------------ documents as units
    def note_document(self, record: DocumentRecord) -> None:
        """Learn which chunks belong to ``record`` (so they are evicted and dropped with it)."""
        with self._lock:
            if record.digest in self._documents:
                return
            self._documents[record.digest] = (anchor_of(record.text), record.chunk_keys)
            for key in record.chunk_keys:
                self._owners.setdefault(key, set()).add(record.digest)
            self._owned_chunks += len(record.chunk_keys)
            self._evicted.pop(anchor_of(record.text), None)

    def group_of(self, key: str) -> str | None:
        """The eviction group of an entry: its document's digest for a record or a document
        chunk, ``None`` (a group of its own) for a prefix chunk."""
        parsed = self.shelf.parse_key(key)
        if parsed is not None:
            return parsed[1]
        with self._lock:
            owners = self._owners.get(key)
            return min(owners) if owners else None

    def record_key(self, record: DocumentRecord) -> str:
        """Key of ``record``'s stored entry."""
        return self.shelf.key_of(anchor_of(record.text), record.digest)

    def kept_in(self, record: DocumentRecord) -> list[str]:
        """Where the document is: the tiers (fastest first) that hold some of its entries,
        when together they hold its record and every chunk; empty when an entry is in no tier
        (the document is gone: a prompt would compute it)."""
        keys = [self.record_key(record), *record.chunk_keys]
        held = {tier.name: {key for key in keys if self._store.holds(tier, key)} for tier in self._store.tiers}
        if set().union(*held.values()) != set(keys):
            return []
        return [name for name, found in held.items() if found]

    def documents_by_tier(self) -> dict[str, int]:
        """Document records each tier holds (reads key names only)."""
        return {tier.name: sum(1 for _ in tier.keys_with_prefix(self.shelf.prefix)) for tier in self._store.tiers}

    def evicted_in(self, text: str) -> int:
        """How many documents that were stored and then evicted start somewhere in ``text``."""
        with self._lock:
            if not self._evicted:
                return 0
            evicted = np.fromiter(self._evicted, dtype=np.int64)
        windows = window_anchors(text, ANCHOR_CHARS)
        found, i = 0, 0
        for position in np.flatnonzero(np.isin(windows, evicted)).tolist():
            if position >= i:
                found += 1
                i = position + ANCHOR_CHARS
        return found

    # ------------------------------------------------------------------ entries leaving
    def _forget(self, key: str) -> None:
        """A key left every tier: drop what describes it, and the rest of its document."""
        parsed = self.shelf.parse_key(key)
        doomed = self._forget_document(*parsed) if parsed is not None else self._forget_chunk(key)
        for other in doomed:
            if self._store.contains(other):
                self._store.delete(other)

    def _forget_document(self, anchor: int, digest: str) -> list[str]:
        """The record of ``digest`` left: forget the document; its chunks no other document
        owns are returned (to delete)."""
        doomed: list[str] = []
        indexed = self._registry.forget(anchor, digest)
        with self._lock:
            known = self._documents.pop(digest, None)
            if known is not None:
                self._owned_chunks -= len(known[1])
                for chunk in known[1]:
                    owners = self._owners.get(chunk)
                    if owners is not None:
                        owners.discard(digest)
                        if not owners:
                            del self._owners[chunk]
                            doomed.append(chunk)
            if indexed or known is not None:
                self._evicted[anchor] = digest
                self._evicted.move_to_end(anchor)
                while len(self._evicted) > MAX_EVICTED_REMEMBERED:
                    self._evicted.popitem(last=False)
        if indexed or known is not None:
            self._on_evicted()
        return doomed

    def _forget_chunk(self, key: str) -> list[str]:
        """A chunk left: drop it from the prefix index; the records of the documents owning it
        are returned (to delete: the documents are incomplete)."""
        self.prefixes.drop(key)
        with self._lock:
            return [
                self.shelf.key_of(known[0], digest)
                for digest in self._owners.get(key, ())
                if (known := self._documents.get(digest)) is not None
            ]

    def clear(self) -> None:
        """Forget every document and prefix (the tiers are cleared by their owner)."""
        self.prefixes.clear()
        self.shelf.parsed.clear()
        self._registry = DocumentRegistry(self.shelf)
        with self._lock:
            self._documents.clear()
            self._owners.clear()
            self._owned_chunks = 0
            self._evicted.clear()
