"""Lookup, write-back and counters for cached K/V. Never calls the model.

Two kinds of entries, both cut into ``chunk_size`` pieces and stored through the tier stack:

- prefix chunks, keyed by :func:`~kvboost_rag.request.hashing.prefix_hash` chains from the prompt's
  first token. Their K/V is exact for any prompt that starts with the same tokens.
- document chunks, keyed by :func:`~kvboost_rag.request.hashing.content_hash` chains from the
  document's own first token. Their K/V is re-rotated and repaired where reused.

Every key comes from a :class:`~kvboost_rag.request.plan.PromptPlan`; this module hashes nothing.

What finds entries lives within the same budgets as the entries: document records are
stored in the tiers (:class:`~kvboost_rag.cache.document_records.DocumentShelf`), so a fresh process
over the same disk folder or Redis finds stored documents; the in-process indexes (the
registry's anchors and the :class:`~kvboost_rag.cache.prefix_index.PrefixIndex`) count against
``max_cache_bytes`` and drop what no tier holds any more.

A document is one unit: the memory tier evicts its record and its chunks together (the
manager names each entry's group, :meth:`CacheManager.group_of`), and when any of them leaves
every tier (a disk tier's own eviction, a corrupt entry), the rest of the document is deleted
and the registry forgets it, so no chunk outlives its record and no record points at missing
chunks. Documents dropped that way are counted and remembered by their anchor, so a prompt
that holds one is told why it missed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvboost_rag.cache.codec import (
    CorruptEntryError,
    KVBlock,
    KVLayout,
    decode_block,
    encode_block,
)
from kvboost_rag.cache.document_records import DocumentShelf
from kvboost_rag.cache.prefix_index import PrefixIndex
from kvboost_rag.cache.storage import DeviceTier, DiskTier, TieredStore
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.prefill.outcome import PrefillOutcome
from kvboost_rag.request.documents import (
    ANCHOR_CHARS,
    DocumentRecord,
    DocumentRegistry,
    anchor_of,
)
from kvboost_rag.request.hashing import window_anchors
from kvboost_rag.request.plan import PromptPlan
from kvboost_rag.results import CacheStats

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: Owner name of the indexes' reservation in the memory tier.
INDEX_RESERVATION = "indexes"
#: Estimated bytes of one document's entry in the ownership map, besides its chunk keys.
DOCUMENT_ENTRY_BYTES = 240
#: Estimated bytes of one chunk key in the ownership maps (key string, set, dict slots).
OWNED_CHUNK_BYTES = 360
#: Evicted documents remembered (by anchor) to explain a prompt that misses them.
MAX_EVICTED_REMEMBERED = 4096


@dataclass(frozen=True)
class PrefixPiece:
    """A stored prefix chunk matched by a prompt: use the first ``length`` rows of ``block``."""

    key: str
    start: int
    length: int
    block: KVBlock


class CacheManager:
    """Finds and stores K/V chunks for one model fingerprint.

    Args:
        store: The tier stack.
        fingerprint: Namespace of every key.
        layout: K/V layout of the model (validates loaded entries).
        settings: Engine settings (chunk size, KV bits).
        device: Where loaded K/V goes.
        dtype: Dtype of loaded K/V.
    """

    def __init__(
        self,
        store: TieredStore,
        fingerprint: str,
        layout: KVLayout,
        settings: KVBoostSettings,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self._store = store
        self.fingerprint = fingerprint
        self.layout = layout
        self.settings = settings
        self.shelf = DocumentShelf(store, fingerprint, settings.chunk_size)
        self._registry = DocumentRegistry(self.shelf)
        self._prefix_index = PrefixIndex()
        self._device, self._dtype = device, dtype
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        # digest -> (anchor, chunk keys) of documents seen in this process; chunk -> digests.
        self._documents: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._owners: dict[str, set[str]] = {}
        self._owned_chunks = 0
        self._evicted: OrderedDict[int, str] = OrderedDict()
        self._maps_lock = threading.RLock()
        self._bytes_per_token: float | None = None
        self.shelf.on_record = self.note_document
        store.group_by(self.group_of)
        store.on_gone(self._forget)
        self.attach_stored_documents()

    # ------------------------------------------------------------------ documents
    def find_document(self, text: str) -> DocumentRecord | None:
        """The stored record of a document text, if any tier holds it."""
        return self._registry.lookup(text)

    def known_documents(self) -> DocumentRegistry:
        """The index of known documents that plans look for in prompts (read-only use; a
        :class:`~kvboost_rag.request.plan.Planner` calls this at each plan, as clearing the cache
        replaces the index)."""
        return self._registry

    @property
    def document_count(self) -> int:
        """Documents known (registered and stored)."""
        return len(self._registry)

    @property
    def memory_used_bytes(self) -> int:
        """Bytes held by the host memory tier."""
        return self._store.memory_tier.used_bytes

    # ------------------------------------------------------------------ indexes
    def attach_stored_documents(self) -> int:
        """Index every document record the tiers hold (written by this process or another);
        reads key names only.

        Returns:
            Documents indexed.
        """
        for anchor, digest in self.shelf.stored():
            self._registry.add_known(anchor, digest)
        self.charge_indexes()
        return len(self._registry)

    def register(self, record: DocumentRecord) -> None:
        """Store a document's record and index it."""
        self._registry.register(record)
        self.charge_indexes()

    @property
    def index_bytes(self) -> int:
        """Estimated bytes of the in-process indexes (counted in the memory budget)."""
        with self._maps_lock:
            owned = len(self._documents) * DOCUMENT_ENTRY_BYTES + self._owned_chunks * OWNED_CHUNK_BYTES
        return self._registry.nbytes + self._prefix_index.nbytes + owned

    # ------------------------------------------------------------------ documents as units
    def note_document(self, record: DocumentRecord) -> None:
        """Learn which chunks belong to ``record`` (so they are evicted and dropped with it)."""
        with self._maps_lock:
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
        with self._maps_lock:
            owners = self._owners.get(key)
            return min(owners) if owners else None

    def record_key(self, record: DocumentRecord) -> str:
        """Key of ``record``'s stored entry."""
        return self.shelf.key_of(anchor_of(record.text), record.digest)

    def kept_in(self, record: DocumentRecord) -> list[str]:
        """Names of the tiers holding ``record`` and every one of its chunks."""
        keys = [self.record_key(record), *record.chunk_keys]
        return [tier.name for tier in self._store.tiers if all(key in tier for key in keys)]

    def documents_by_tier(self) -> dict[str, int]:
        """Document records each tier holds (reads key names only)."""
        return {tier.name: sum(1 for _ in tier.keys_with_prefix(self.shelf.prefix)) for tier in self._store.tiers}

    def evicted_in(self, text: str) -> int:
        """How many documents that were stored and then evicted start somewhere in ``text``."""
        with self._maps_lock:
            if not self._evicted:
                return 0
            evicted = set(self._evicted)
        windows = window_anchors(text, ANCHOR_CHARS)
        found, i = 0, 0
        for position in np.flatnonzero(np.isin(windows, np.fromiter(evicted, dtype=np.int64))).tolist():
            if position >= i:
                found += 1
                i = position + ANCHOR_CHARS
        return found

    def charge_indexes(self) -> None:
        """Count the indexes' bytes against the memory budget (evicting entries if needed)."""
        self._store.reserve(INDEX_RESERVATION, self.index_bytes)

    def _forget(self, key: str) -> None:
        """A key left every tier: drop what describes it, and the rest of its document."""
        parsed = self.shelf.parse_key(key)
        doomed: list[str] = []
        if parsed is not None:
            anchor, digest = parsed
            indexed = self._registry.forget(anchor, digest)
            with self._maps_lock:
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
                self._count({"documents_evicted": 1})
        else:
            self._prefix_index.drop(key)
            with self._maps_lock:
                for digest in self._owners.get(key, ()):
                    known = self._documents.get(digest)
                    if known is not None:
                        doomed.append(self.shelf.key_of(known[0], digest))
        for other in doomed:
            if self._store.contains(other):
                self._store.delete(other)

    # ------------------------------------------------------------------ blocks
    def load(self, key: str) -> KVBlock | None:
        """The block stored under ``key``; a corrupt entry is deleted and counts as a miss."""
        found = self._store.fetch(key)
        if found is None:
            return None
        entry, trusted = found
        try:
            return decode_block(
                entry,
                fingerprint=self.fingerprint,
                expected_layout=self.layout.as_tuple(),
                device=self._device,
                dtype=self._dtype,
                trusted=trusted,
            )
        except CorruptEntryError as exc:
            _warnings.warning("corrupt-entry", "dropping corrupt cache entry %s: %s", key[:12], exc)
            self._store.delete(key)
            self._count({"corrupt_entries": 1})
            return None

    def _save(self, key: str, keys: torch.Tensor, values: torch.Tensor, token_ids: Sequence[int], start: int) -> None:
        block = KVBlock(
            keys=keys, values=values, token_ids=torch.tensor(list(token_ids), dtype=torch.long), start_position=start
        )
        entry = encode_block(
            block, fingerprint=self.fingerprint, bits=self.settings.kv_cache_bits, group_size=self.settings.kv_group_size
        )
        self._store.put(key, entry)

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, plan: PromptPlan) -> list[PrefixPiece]:
        """Longest run of stored prefix chunks matching the start of the planned prompt.

        Grid chunks are found by hash (so entries written by another process hit too); the
        last piece may be a shorter stored chunk, or the leading part of one, found through
        the in-process index. Rows of a prefix chunk depend only on the tokens before them,
        so a leading part of a chunk is exact.
        """
        pieces: list[PrefixPiece] = []
        parent, pos = plan.root, 0
        for chunk in plan.prefix_chunks:
            block = self.load(chunk.key)
            if block is None:
                break
            pieces.append(PrefixPiece(chunk.key, chunk.start, chunk.length, block))
            parent, pos = chunk.key, chunk.stop
        tail = plan.prefix_tail
        if tail is not None and tail.start == pos:
            block = self.load(tail.key)
            if block is not None:
                return [*pieces, PrefixPiece(tail.key, tail.start, tail.length, block)]
        if pos < plan.lookup_limit:
            piece = self._partial_prefix(parent, plan.tokens.ids, pos, plan.lookup_limit)
            if piece is not None:
                pieces.append(piece)
        return pieces

    def _partial_prefix(self, parent: str, ids: Sequence[int], pos: int, end: int) -> PrefixPiece | None:
        children = self._prefix_index.children(parent)
        best: tuple[int, str] | None = None
        for key, tokens in children:
            length = 0
            limit = min(len(tokens), end - pos)
            while length < limit and tokens[length] == ids[pos + length]:
                length += 1
            if length and (best is None or length > best[0]):
                best = (length, key)
        if best is None:
            return None
        block = self.load(best[1])
        if block is None:
            self._prefix_index.drop(best[1])
            return None
        return PrefixPiece(best[1], pos, best[0], block)

    def bytes_per_token(self) -> float:
        """Bytes a stored K/V entry takes per token with these settings (one chunk measured)."""
        if self._bytes_per_token is None:
            layers, heads, head_dim = self.layout.as_tuple()
            size = self.settings.chunk_size
            zeros = torch.zeros(layers, heads, size, head_dim, dtype=self._dtype)
            block = KVBlock(keys=zeros, values=zeros, token_ids=torch.zeros(size, dtype=torch.long), start_position=0)
            entry = encode_block(
                block, fingerprint=self.fingerprint, bits=self.settings.kv_cache_bits, group_size=self.settings.kv_group_size
            )
            self._bytes_per_token = entry.nbytes / size
        return self._bytes_per_token

    def tier_budgets(self) -> tuple[int, int | None]:
        """Bytes the tiers can take: the memory tier's budget left beside its reservations, and
        the budgets of the tiers below it (disk), ``None`` when one is unbounded (Redis), 0
        when there are none. A device tier holds copies of memory entries: not counted."""
        memory = self._store.memory_tier
        lower: int | None = 0
        for tier in self._store.tiers:
            if tier is memory or isinstance(tier, DeviceTier):
                continue
            budget = tier.max_bytes if isinstance(tier, DiskTier) else None
            lower = None if budget is None or lower is None else lower + budget
        return memory.max_bytes - memory.reserved_bytes, lower

    def missing_chunks(self, record: DocumentRecord, chunks: Sequence[int] | None = None) -> list[int]:
        """Indices of the document's chunks (of ``chunks``, default all) that no tier holds."""
        indices = range(len(record.chunk_keys)) if chunks is None else chunks
        return [i for i in indices if not self._store.contains(record.chunk_keys[i])]

    # ------------------------------------------------------------------ write-back
    def write_back(self, plan: PromptPlan, outcome: PrefillOutcome, *, store_documents: bool, pin: bool = False) -> int:
        """Store what the prompt taught: its exact leading part as prefix chunks, and the
        chunks of its documents that no tier holds yet, cut from the prompt's own K/V.

        Args:
            plan: The prompt's plan.
            outcome: Its prefill outcome.
            store_documents: Store document chunks too.
            pin: Pin the prefix chunks that serve the leading part (an explicit warm).
                Pinning writes nothing: a text already stored costs no write.

        Returns:
            Document tokens newly stored.
        """
        ids = plan.tokens.ids
        h = outcome.prefix_tokens
        saved = 0
        served = list(outcome.prefix_keys)
        for chunk in plan.stored_prefix:
            if chunk.stop <= h:
                continue  # served by the chunks that hit
            if not self._store.contains(chunk.key):
                self._save(
                    chunk.key,
                    outcome.keys[:, :, chunk.start : chunk.stop].clone(),
                    outcome.values[:, :, chunk.start : chunk.stop].clone(),
                    ids[chunk.start : chunk.stop],
                    chunk.start,
                )
                saved += 1
            if self._store.contains(chunk.key):  # not stored when larger than every budget
                self._prefix_index.add(chunk.parent, chunk.key, ids[chunk.start : chunk.stop])
            served.append(chunk.key)
        if pin:
            for key in served:
                self._store.pin(key)
        stored_chunks: list[str] = []
        document_tokens = 0
        if store_documents:
            for document in outcome.documents:
                record = document.record
                self.note_document(record)
                stored_before = len(stored_chunks)
                for index, key in enumerate(record.chunk_keys):
                    if key in outcome.loaded_chunks or key in stored_chunks or self._store.contains(key):
                        continue
                    first = document.chunk_span(index)
                    if first is None:
                        continue  # not wholly in this prompt, or split by a boundary merge
                    lo = index * record.chunk_size
                    length = record.chunk_length(index)
                    self._save(
                        key,
                        outcome.keys[:, :, first : first + length].clone(),
                        outcome.values[:, :, first : first + length].clone(),
                        record.token_ids[lo : lo + length],
                        first,
                    )
                    stored_chunks.append(key)
                    document_tokens += length
                if len(stored_chunks) > stored_before:
                    # The record goes in after its chunks: the document's newest entry.
                    self._registry.register(record)
        if saved or stored_chunks:
            self._count({"stored_entries": saved + len(stored_chunks)})
        self.charge_indexes()
        return document_tokens

    # ------------------------------------------------------------------ counters
    def record(self, plan: PromptPlan, outcome: PrefillOutcome) -> None:
        """Add one prompt's reuse figures to the counters."""
        self._count(
            {
                "prompts": 1,
                "prompt_tokens": plan.num_tokens,
                "prefix_hit_tokens": outcome.prefix_tokens,
                "content_hit_tokens": outcome.content_tokens,
                "recomputed_tokens": outcome.recomputed_tokens,
                "boundary_merged_tokens": outcome.merged_tokens,
            }
        )

    def stats(self) -> CacheStats:
        """Counters of the cache and its tiers."""
        memory = self._store.memory_tier
        return CacheStats(
            entries=len(list(memory.keys())),
            memory_bytes=memory.used_bytes,
            index_bytes=self.index_bytes,
            prefix_index_entries=len(self._prefix_index),
            documents=len(self._registry),
            documents_evicted=self.counters["documents_evicted"],
            documents_by_tier=self.documents_by_tier(),
            tiers=self._store.stats(),
            misses=self._store.misses,
            counters=dict(self.counters),
            shared_bytes_written=self.shared_bytes_written(),
        )

    def shared_bytes_written(self) -> int:
        """Bytes written to the shared tiers: Redis counts them; a write-through disk folder's
        usage stands in for it (exact for one writer)."""
        total = 0
        for tier in self._store.tiers:
            if tier.name == "redis":
                total += int(getattr(tier, "bytes_written", 0))
            elif tier.name == "disk" and not tier.spill_only:
                total += int(tier.used_bytes)
        return total

    def eviction_context(self) -> tuple[int, int, bool]:
        """Documents evicted so far, the memory tier's budget, and whether a lower tier exists
        (what a warning about evicted documents explains)."""
        return self.counters["documents_evicted"], self._store.memory_tier.max_bytes, len(self._store.tiers) > 1

    def _count(self, amounts: dict[str, int]) -> None:
        with self._lock:
            self.counters.update(amounts)

    def clear(self) -> None:
        """Drop every entry and index."""
        self._store.clear()
        self._prefix_index.clear()
        self.shelf.parsed.clear()
        self._registry = DocumentRegistry(self.shelf)
        with self._maps_lock:
            self._documents.clear()
            self._owners.clear()
            self._owned_chunks = 0
            self._evicted.clear()
        self.charge_indexes()
