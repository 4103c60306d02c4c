"""Lookup, write-back and counters for cached K/V over the tiers. Never calls the model.

Two kinds of entries, both cut into ``chunk_size`` pieces and stored through the tier stack:

- prefix chunks, keyed by :func:`~kvboost_rag.request.hashing.prefix_hash` chains from the prompt's
  first token. Their K/V is exact for any prompt that starts with the same tokens.
- document chunks, keyed by :func:`~kvboost_rag.request.hashing.content_hash` chains from the
  document's own first token. Their K/V is re-rotated and repaired where reused.

Every key comes from a :class:`~kvboost_rag.request.plan.PromptPlan`; this module hashes nothing.

What finds entries (document records, the registry, the prefix index) is the
:class:`~kvboost_rag.cache.index.CacheIndex`: this module reads and writes blocks, the index
says what they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvboost_rag.cache.codec import (
    CorruptEntryError,
    KVBlock,
    KVLayout,
    decode_block,
    encode_block,
)
from kvboost_rag.cache.host_copies import HostCopies
from kvboost_rag.cache.index import CacheIndex
from kvboost_rag.cache.write_back import Prefilled, WriteBack
from kvboost_rag.cache.write_worker import WriteWorker
from kvboost_rag.cache.storage import DeviceTier, DiskTier, TieredStore
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.documents import (
    DocumentRecord,
)
from kvboost_rag.request.plan import PromptPlan
from kvboost_rag.results import CacheStats, KVMemory

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: Owner name of the indexes' reservation in the memory tier.
INDEX_RESERVATION = "indexes"
#: Name of the copier's thread.
COPIER_THREAD = "kvboost-write-copies"
#: Seconds :meth:`CacheManager.stats` waits for the writes queued before it at most: the
#: figures then leave out what a slow tier has not taken yet (a warning says how much), so a
#: caller asking for them (a server's ``GET /v1/documents``) never waits on a wedged tier.
STATS_FLUSH_SECONDS = 2.0
#: Smallest bound on the bytes of queued write-backs (``max_batch_cache_bytes`` when larger).
MIN_QUEUED_BYTES = 256 * 1024**2


def queued_bytes_bound(settings: KVBoostSettings) -> int:
    """Bytes each of the write-back's queues may hold: ``max_batch_cache_bytes``, at least
    :data:`MIN_QUEUED_BYTES`."""
    return max(settings.max_batch_cache_bytes, MIN_QUEUED_BYTES)


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
        self._device, self._dtype = device, dtype
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._bytes_per_token: float | None = None
        self._charge_queued = False
        queued = queued_bytes_bound(settings)
        #: Copies what every write-back stores into host memory, one after another, off the
        #: requests' threads (its queue bounds the buffers of its own and device copies held).
        self.copier = WriteWorker(queued, name=COPIER_THREAD)
        #: Puts those copies into the tiers (its queue bounds the host copies on their way).
        self.writer = WriteWorker(queued)
        #: The documents and prefix chunks the tiers hold.
        self.index = CacheIndex(
            store, fingerprint, settings.chunk_size, self.charge_indexes, lambda: self._count({"documents_evicted": 1})
        )
        #: Gathers and host copies of what the write-back stores (its arena: ``copies.arena``).
        self.copies = HostCopies(torch.device(device), dtype)
        self._write_back = WriteBack(
            store, self.index, self.copies, self.copier, self.writer, fingerprint, settings.kv_cache_bits, settings.kv_group_size,
            self._count, self.charge_indexes,
        )
        self.index.shelf.write = self._write_back.write_later
        self.index.attach_stored_documents()

    @property
    def memory_used_bytes(self) -> int:
        """Bytes held by the host memory tier."""
        return self._store.memory_tier.used_bytes

    @property
    def index_bytes(self) -> int:
        """Estimated bytes of the in-process indexes (counted in the memory budget)."""
        return self.index.nbytes

    def charge_indexes(self) -> None:
        """Count the indexes' bytes against the memory budget (evicting entries if needed).

        An eviction may spill entries to disk, so the charge runs on the write-back's writer:
        at once when called there, else queued (once, however often it is asked for meanwhile).
        """
        if self.writer.on_worker():
            self._store.reserve(INDEX_RESERVATION, self.index.nbytes)
            return
        with self._lock:
            if self._charge_queued:
                return
            self._charge_queued = True
        self.writer.submit(self._charge_now)

    def _charge_now(self) -> None:
        with self._lock:
            self._charge_queued = False
        self._store.reserve(INDEX_RESERVATION, self.index.nbytes)

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
        children = self.index.prefixes.children(parent)
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
            self.index.prefixes.drop(best[1])
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
    def write_back(
        self,
        plan: PromptPlan,
        outcome: Prefilled,
        *,
        store_documents: bool,
        pin: bool = False,
        on_read: Callable[[], None] | None = None,
    ) -> int:
        """Store what the prompt taught: its exact leading part as prefix chunks, and the
        chunks of its documents that no tier holds yet, cut from the prompt's own K/V.

        Returns as soon as the new chunks are staged: every lookup from then on finds them;
        copying them into host memory and putting them into the tiers (serializing them for
        disk and Redis) runs on the write-back's worker (:meth:`flush` waits for it). Arguments
        and result: :meth:`~kvboost_rag.cache.write_back.WriteBack.submit`.
        """
        return self._write_back.submit(plan, outcome, store_documents=store_documents, pin=pin, on_read=on_read)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far reached the tiers; whether it did within
        ``timeout`` seconds (``None``: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.copier.flush(timeout):
            return False
        return self.writer.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))


    # ------------------------------------------------------------------ counters
    def record(self, plan: PromptPlan, outcome: Prefilled) -> None:
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

    def stats(self, held: KVMemory | None = None, flush_timeout: float | None = STATS_FLUSH_SECONDS) -> CacheStats:
        """Counters of the cache and its tiers, once the writes queued so far are done, or
        after ``flush_timeout`` seconds without the ones still queued then (logged).

        Args:
            held: What the engine's other holders hold (buffers, weight copies, limits): the
                cache's own holders are filled in.
            flush_timeout: Seconds to wait for the queued writes at most (``None``: no limit;
                ``0``: the figures as they stand).
        """
        if not self.flush(flush_timeout):
            jobs = self.copier.pending[0] + self.writer.pending[0]
            _warnings.warning(
                "stats-unflushed",
                "cache stats after %.1f s without %d cache writes still queued (a slow tier): their entries are not counted yet",
                flush_timeout, jobs,
            )
        memory = self._store.memory_tier
        return CacheStats(
            memory=self.memory_account(held or KVMemory()),
            entries=len(list(memory.keys())),
            memory_bytes=memory.used_bytes,
            index_bytes=self.index_bytes,
            prefix_index_entries=len(self.index.prefixes),
            documents=self.index.document_count,
            documents_evicted=self.counters["documents_evicted"],
            documents_by_tier=self.index.documents_by_tier(),
            tiers=self._store.stats(),
            misses=self._store.misses,
            counters=dict(self.counters),
            shared_bytes_written=self.shared_bytes_written(),
        )

    def memory_account(self, held: KVMemory) -> KVMemory:
        """``held`` with the bytes the cache's own holders hold now: the write-back's queues,
        staged entries, the arena, the memory and device tiers (and their limits)."""
        device = sum(tier.used_bytes for tier in self._store.tiers if isinstance(tier, DeviceTier))
        limits = {"max_cache_bytes": self._store.memory_tier.max_bytes, "max_queued_bytes": self.writer.max_queued_bytes}
        return held.model_copy(
            update={
                "copy_queue_bytes": self.copier.queued_bytes,
                "write_queue_bytes": self.writer.queued_bytes,
                "staged_entries": self._store.staged_count,
                "staged_bytes": self._store.staged_bytes,
                "arena_bytes": self.copies.arena.segment_bytes,
                "arena_used_bytes": self.copies.arena.used_bytes,
                "memory_tier_bytes": self._store.memory_tier.used_bytes,
                "device_tier_bytes": device,
                "limits": {**held.limits, **limits},
            }
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
        """Drop every entry and index (after the writes queued so far)."""
        self.flush()
        self._store.clear()
        self.index.clear()
        self.charge_indexes()
        self.flush()
        self.copies.arena.trim()  # the host memory the entries held goes back to the system
