"""The write-back: what a prompt taught the cache, stored without holding up its call.

Two halves, on two threads:

- :meth:`WriteBack.submit`, on the request's thread once its answer is done: decides which
  chunks are new (the prompt's exact leading part as prefix chunks, and the chunks of its
  documents that no tier holds), indexes them, and *stages* them in the tier stack
  (:meth:`~kvboost_rag.cache.storage.TieredStore.stage`) over the prompt's own buffers, so a
  request that starts after this call returned finds every one of them. On CUDA the chunks are
  first copied on the device (:meth:`~kvboost_rag.cache.host_copies.HostCopies.gather`), those
  copies go into the device tier as they are, and the prompt's buffers (its captured steps'
  slot) are handed back at once. Nothing is copied to the host, put into a host tier,
  serialized or hashed here.
- the job it queues on the :class:`~kvboost_rag.cache.write_worker.WriteWorker`: copies the
  chunks into host memory the cache owns (:class:`~kvboost_rag.cache.arena.HostArena`), hands the
  prompt's buffers back (on a CPU), puts the copies into the memory, disk and Redis tiers, and
  settles what it staged.

Every key comes from the prompt's :class:`~kvboost_rag.request.plan.PromptPlan`; nothing here
hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvboost_rag.cache.codec import KVBlock, encode_block, entry_in_place
from kvboost_rag.cache.host_copies import HostCopies
from kvboost_rag.cache.index import CacheIndex
from kvboost_rag.cache.storage import StoredEntry, TieredStore
from kvboost_rag.cache.write_worker import WriteWorker
from kvboost_rag.request.plan import PlacedDocument, PromptPlan

if TYPE_CHECKING:
    from kvboost_rag.cache.manager import Prefilled


@dataclass
class ChunkWrite:
    """One chunk on its way to the tiers.

    Attributes:
        key: Its cache key.
        keys: ``[layers, kv_heads, tokens, head_dim]``: a view of the prompt's buffers, or its
            device copy (CUDA).
        values: Same for V.
        token_ids: ``[tokens]`` int64 on the host.
        start: Position of its first token in the prompt.
        staged: The entry lookups see until the tiers hold it.
    """

    key: str
    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor
    start: int
    staged: StoredEntry | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its K and V."""
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class WriteJob:
    """What one write-back stores.

    Attributes:
        chunks: The new chunks.
        indexed_prefixes: Prefix chunks indexed when staged: dropped from the index again when
            no tier kept them.
        pins: Keys to pin in every tier once stored.
        release: Hands the prompt's buffers back (called once, when nothing reads them any more).
    """

    chunks: list[ChunkWrite] = field(default_factory=list)
    indexed_prefixes: list[str] = field(default_factory=list)
    pins: list[str] = field(default_factory=list)
    release: Callable[[], None] | None = None

    def release_buffers(self) -> None:
        """Hand the prompt's buffers back (again: nothing)."""
        release, self.release = self.release, None
        if release is not None:
            release()


class WriteBack:
    """Stages a prompt's new chunks at once and stores them on the worker.

    Args:
        store: The tier stack.
        index: The cache's index.
        copies: Gathers and host copies of K/V for the model's device.
        worker: Where the stores run.
        fingerprint: Namespace of every entry.
        bits: KV quantization bits of stored entries (``None``: the model's dtype).
        group_size: Their quantization group size.
        count: Adds to the cache's counters.
        charge: Charges the index's bytes against the memory budget (on the worker).
    """

    def __init__(
        self,
        store: TieredStore,
        index: CacheIndex,
        copies: HostCopies,
        worker: WriteWorker,
        fingerprint: str,
        bits: int | None,
        group_size: int,
        count: Callable[[dict[str, int]], None],
        charge: Callable[[], None],
    ) -> None:
        self._store, self._index, self._copies, self._worker = store, index, copies, worker
        self._fingerprint, self._bits, self._group_size = fingerprint, bits, group_size
        self._count, self._charge = count, charge

    # ------------------------------------------------------------------ the request's thread
    def submit(
        self,
        plan: PromptPlan,
        outcome: Prefilled,
        *,
        store_documents: bool,
        pin: bool = False,
        on_read: Callable[[], None] | None = None,
    ) -> int:
        """Stage what the prompt taught and queue its storing (see the module docstring).

        Args:
            plan: The prompt's plan.
            outcome: Its prefill outcome (its buffers hold the K/V).
            store_documents: Store document chunks too.
            pin: Pin the prefix chunks that serve the leading part (an explicit warm).
            on_read: Called once when the prompt's buffers are no longer read (they may be
                lent again): at once on CUDA or when nothing is new, else after the worker
                copied them. Called even when this raises.

        Returns:
            Document tokens newly staged.
        """
        job = WriteJob(release=on_read)
        try:
            self._plan_prefix(plan, outcome, pin, job)
            tokens = sum(self._plan_document(d, outcome, job) for d in outcome.documents) if store_documents else 0
            self._stage(job)
        except BaseException:
            job.release_buffers()
            raise
        if self._copies.frees_buffers_at_once or not job.chunks:
            job.release_buffers()
        if job.chunks or job.pins:
            self._worker.submit(partial(self._persist, job), sum(chunk.nbytes for chunk in job.chunks))
        else:  # nothing new: only the index may have grown
            self._charge()
        return tokens

    def write_later(self, key: str, entry: StoredEntry, on_missing: Callable[[], None] | None = None) -> None:
        """Stage ``entry`` (it must own its memory) and put it into the tiers on the worker;
        ``on_missing`` runs there when no tier kept it."""
        self._store.stage(key, entry)
        self._worker.submit(partial(self._put_staged, key, entry, on_missing), entry.nbytes)

    def _plan_prefix(self, plan: PromptPlan, outcome: Prefilled, pin: bool, job: WriteJob) -> None:
        """The chunks of the prompt's leading part that the prefix hit did not serve and no
        tier holds, indexed at once; with ``pin``, every chunk of that part to pin."""
        ids = plan.tokens.ids
        if pin:
            job.pins.extend(outcome.prefix_keys)  # the chunks that hit
        for chunk in plan.stored_prefix:
            if chunk.stop <= outcome.prefix_tokens:
                continue  # served by the chunks that hit
            rows = slice(chunk.start, chunk.stop)
            if not self._store.contains(chunk.key):
                job.chunks.append(self._chunk(chunk.key, outcome, rows, ids[rows], chunk.start))
                job.indexed_prefixes.append(chunk.key)
            self._index.prefixes.add(chunk.parent, chunk.key, ids[rows])
            if pin:
                job.pins.append(chunk.key)

    def _plan_document(self, document: PlacedDocument, outcome: Prefilled, job: WriteJob) -> int:
        """The chunks of ``document`` that sit whole in the prompt and that no tier holds (then
        its record is registered); returns their tokens."""
        record = document.record
        self._index.note_document(record)
        planned = {chunk.key for chunk in job.chunks}
        tokens = 0
        for index, key in enumerate(record.chunk_keys):
            if key in outcome.loaded_chunks or key in planned or self._store.contains(key):
                continue
            first = document.chunk_span(index)
            if first is None:
                continue  # not wholly in this prompt, or split by a boundary merge
            lo, length = index * record.chunk_size, record.chunk_length(index)
            job.chunks.append(self._chunk(key, outcome, slice(first, first + length), record.token_ids[lo : lo + length], first))
            planned.add(key)
            tokens += length
        if tokens:
            self._index.register(record)
        return tokens

    @staticmethod
    def _chunk(key: str, outcome: Prefilled, rows: slice, token_ids, start: int) -> ChunkWrite:
        assert outcome.keys is not None and outcome.values is not None
        return ChunkWrite(
            key, outcome.keys[:, :, rows], outcome.values[:, :, rows], torch.tensor(list(token_ids), dtype=torch.long), start
        )

    def _stage(self, job: WriteJob) -> None:
        """Gather the chunks (device copies on CUDA) and stage them; unquantized device copies
        go into the device tier as they are."""
        gathered = self._copies.gather([t for chunk in job.chunks for t in (chunk.keys, chunk.values)])
        for i, chunk in enumerate(job.chunks):
            chunk.keys, chunk.values = gathered[2 * i], gathered[2 * i + 1]
            chunk.staged = entry_in_place(
                KVBlock(chunk.keys, chunk.values, chunk.token_ids, chunk.start), fingerprint=self._fingerprint
            )
            self._store.stage(chunk.key, chunk.staged)
        if self._on_device and job.chunks:
            self._store.put_device([(chunk.key, chunk.staged) for chunk in job.chunks])

    @property
    def _on_device(self) -> bool:
        """Whether the gathered chunks are device copies the device tier holds as they are."""
        return self._copies.frees_buffers_at_once and self._bits is None and self._store.has_device_tier

    # ------------------------------------------------------------------ the worker
    def _persist(self, job: WriteJob) -> None:
        """Copy the job's chunks into memory of the cache's own and stage those copies instead
        of the views, hand the buffers back, put the copies into the tiers, then settle the
        index."""
        try:
            owned = self._owned(job.chunks)
            staged = [self._staged_now(chunk, entry) for chunk, entry in zip(job.chunks, owned)]
        except BaseException:
            for chunk in job.chunks:
                if chunk.staged is not None:
                    self._store.settle(chunk.key, chunk.staged)  # the views must not outlive the buffers
            raise
        finally:
            job.release_buffers()
        stored = 0
        for chunk, entry, visible in zip(job.chunks, owned, staged):
            if visible is None:
                continue  # deleted (or staged anew) since
            self._store.put(chunk.key, entry, device=not self._on_device)
            self._store.settle(chunk.key, visible)
            stored += 1
        for key in job.indexed_prefixes:
            if not self._store.contains(key):  # not kept: larger than every budget
                self._index.prefixes.drop(key)
        for key in job.pins:
            self._store.pin(key)
        if stored:
            self._count({"stored_entries": stored})
        self._charge()

    def _staged_now(self, chunk: ChunkWrite, copy: StoredEntry) -> StoredEntry | None:
        """What lookups of ``chunk`` find staged until the tiers hold it; ``None`` when it was
        deleted or staged anew since. A staged view of lent buffers is replaced by ``copy``
        (nothing reads the buffers from here on); a staged device copy owns its memory and
        stays, so lookups keep finding it on the device."""
        if chunk.staged is None:
            return None
        if self._copies.frees_buffers_at_once:
            return chunk.staged if self._store.staged(chunk.key) is chunk.staged else None
        return copy if self._store.restage(chunk.key, chunk.staged, copy) else None

    def _owned(self, chunks: list[ChunkWrite]) -> list[StoredEntry]:
        """Stored entries of ``chunks`` in host memory of their own: arena copies, or
        quantized entries."""
        if self._bits is not None:
            return [
                encode_block(
                    KVBlock(c.keys, c.values, c.token_ids, c.start),
                    fingerprint=self._fingerprint, bits=self._bits, group_size=self._group_size,
                )
                for c in chunks
            ]
        copies = self._copies.to_host([t for chunk in chunks for t in (chunk.keys, chunk.values)])
        return [
            entry_in_place(KVBlock(copies[2 * i], copies[2 * i + 1], c.token_ids, c.start), fingerprint=self._fingerprint)
            for i, c in enumerate(chunks)
        ]

    def _put_staged(self, key: str, entry: StoredEntry, on_missing: Callable[[], None] | None) -> None:
        if self._store.staged(key) is not entry:
            return  # deleted (or staged anew) since
        self._store.put(key, entry)
        self._store.settle(key, entry)
        if on_missing is not None and not self._store.contains(key):
            on_missing()
        self._charge()
