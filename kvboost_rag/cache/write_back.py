"""The write-back: what a prompt taught the cache, stored without holding up its call.

A chunk's K/V has one owner from the moment the write-back takes it until a tier holds it or
it is dropped: the :class:`WriteJob` it belongs to. It goes through three hands, each on its
own thread:

1. :meth:`WriteBack.submit`, on the request's thread once its answer is done: decides which
   chunks are new (the prompt's exact leading part as prefix chunks, and the chunks of its
   documents that no tier holds), indexes them, and *stages* them in the tier stack
   (:meth:`~kvboost_rag.cache.storage.TieredStore.stage`) over the prompt's own buffers, so a
   request that starts after this call returned finds every one of them (a lookup copies such
   a view out under a counted hold on the buffers,
   :class:`~kvboost_rag.host_memory.counted_hold.CountedHold`). On CUDA the chunks are
   first copied on the device (:meth:`~kvboost_rag.cache.host_copies.HostCopies.gather`), those
   copies go into the device tier as they are, and the prompt's buffers are handed back at
   once. Nothing is copied to the host, put into a host tier, serialized or hashed here.
2. the *copier* (a :class:`~kvboost_rag.cache.write_worker.WriteWorker`): copies the chunks
   into host memory the cache owns (:class:`~kvboost_rag.host_memory.arena.HostArena`), stages those
   copies in place of the views, and releases the job's hold on the prompt's buffers (they go
   back once no lookup is copying a view of them). Its jobs wait only for
   each other (copies), never for a slow tier, so buffers go back within a copy's time.
3. the *writer* (another worker): puts the copies into the memory, disk and Redis tiers,
   settles them, and fixes the index for what no tier kept.

Every failure settles: whatever raises at any step (a tier's ``put`` with any exception, a
copy, a submit interrupted), the chunks it left staged are unstaged before the buffers they
view go back, the prefix chunks indexed for them are dropped when no tier holds them, and the
buffers go back exactly once. Memory each hand holds is counted: the prompt's buffers, whole
(lent or its own), or its device copies, in the copier's queue; host copies in the writer's
queue.

Every key comes from the prompt's :class:`~kvboost_rag.request.plan.PromptPlan`; nothing here
hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from kvboost_rag.cache.codec import KVBlock, encode_block, entry_in_place
from kvboost_rag.cache.host_copies import HostCopies
from kvboost_rag.cache.index import CacheIndex
from kvboost_rag.cache.storage import StoredEntry, TieredStore
from kvboost_rag.cache.storage.base import CopyUnderWay, LentEntry, TierWriteError
from kvboost_rag.cache.write_worker import WriteWorker
from kvboost_rag.host_memory.counted_hold import CountedHold
from kvboost_rag.request.documents import DocumentRecord
from kvboost_rag.request.plan import PlacedDocument, PromptPlan


class Prefilled(Protocol):
    """What write-back and the counters read of a prompt's prefill (its
    :class:`~kvboost_rag.prefill.outcome.PrefillOutcome`): the buffers holding the prompt's
    K/V, what was served from cache, and where its documents sit."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    prefix_tokens: int
    prefix_keys: tuple[str, ...]
    documents: list[PlacedDocument]
    loaded_chunks: frozenset[str]
    content_tokens: int
    recomputed_tokens: int
    merged_tokens: int


#: What a chunk holds once it let go of the prompt's buffers.
_NOTHING = torch.empty(0)


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

    def let_go(self) -> None:
        """Drop its views of the prompt's buffers (what it stores is staged by now)."""
        self.keys = self.values = _NOTHING


@dataclass
class WriteJob:
    """What one write-back stores, and everything it holds until it settled.

    Attributes:
        chunks: The new chunks.
        indexed_prefixes: Prefix chunks indexed when staged: dropped from the index again when
            no tier kept them.
        pins: Keys to pin in every tier once stored.
        records: Document records to register once the job is handed to the copier (not
            before: a job refused at submit leaves no record behind).
        release: Lets go of the prompt's buffers (called once): hands lent buffers back on
            CUDA, once the chunks are gathered into device copies; on a CPU, releases the job's
            reference on their :attr:`hold` (once the copier staged copies of the chunks).
        owned: The chunks' copies in memory of the cache's own, once the copier made them.
        source: The prompt's K and V the chunks are cut from, while they are planned.
        hold: The hold on lent host buffers whose views it stages (a lookup copying a staged
            view holds them too); ``None`` on CUDA and for buffers of the prompt's own.
        copy: The copier's progress on the views of lent buffers (with ``hold``), which lookups
            of them wait for once it started.
    """

    chunks: list[ChunkWrite] = field(default_factory=list)
    indexed_prefixes: list[str] = field(default_factory=list)
    pins: list[str] = field(default_factory=list)
    records: list[DocumentRecord] = field(default_factory=list)
    release: Callable[[], None] | None = None
    owned: list[StoredEntry] = field(default_factory=list)
    source: tuple[torch.Tensor, torch.Tensor] | None = None
    hold: CountedHold | None = None
    copy: CopyUnderWay | None = None

    def release_buffers(self) -> None:
        """Hand the prompt's buffers back (again: nothing)."""
        release, self.release = self.release, None
        if release is not None:
            release()

    @property
    def owned_bytes(self) -> int:
        """Bytes of the copies it holds."""
        return sum(entry.nbytes for entry in self.owned)


def _storage_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of the buffer ``tensor`` is, whole (what holding it keeps from the next request;
    a lent buffer is a range of a larger segment: its own bytes, not the segment's)."""
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class WriteBack:
    """Stages a prompt's new chunks at once, copies them on the copier and stores them on the
    writer.

    Args:
        store: The tier stack.
        index: The cache's index.
        copies: Gathers and host copies of K/V for the model's device.
        copier: Where the copies into host memory run.
        writer: Where the stores into the tiers run.
        fingerprint: Namespace of every entry.
        bits: KV quantization bits of stored entries (``None``: the model's dtype).
        group_size: Their quantization group size.
        count: Adds to the cache's counters.
        charge: Charges the index's bytes against the memory budget (on the writer).
    """

    def __init__(
        self,
        store: TieredStore,
        index: CacheIndex,
        copies: HostCopies,
        copier: WriteWorker,
        writer: WriteWorker,
        fingerprint: str,
        bits: int | None,
        group_size: int,
        count: Callable[[dict[str, int]], None],
        charge: Callable[[], None],
    ) -> None:
        self._store, self._index, self._copies = store, index, copies
        self._copier, self._writer = copier, writer
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
            on_read: Hands the prompt's lent buffers back once they are no longer read: at
                once on CUDA, else once the copier staged copies of the chunks in place of
                the views and no lookup is copying a staged view (at once when nothing is
                new). Called once even when this raises. ``None``: the buffers are
                the outcome's own. Either way they count, whole, in the copier's queue until
                it ran the job.

        Returns:
            Document tokens newly staged.
        """
        job = self._job(outcome, on_read)
        try:
            self._plan_prefix(plan, outcome, pin, job)
            tokens = sum(self._plan_document(d, outcome, job, plan.is_new_block(d)) for d in outcome.documents) if store_documents else 0
            job.source = None  # from here on, only the chunks' views hold the buffers
            self._stage(job)
            if self._copies.frees_buffers_at_once or not job.chunks:
                job.release_buffers()
            if job.chunks or job.pins:
                self._copier.submit(partial(self._take_copies, job), self._held_bytes(job, outcome))
            else:  # nothing new: only the index may have grown
                self._charge()
        except BaseException:
            self._drop(job)
            raise
        written = {chunk.key for chunk in job.chunks}
        for record in job.records:
            self._register_whole(record, written)
        return tokens

    def _register_whole(self, record: DocumentRecord, written: set[str]) -> None:
        """Register ``record`` unless a chunk of it among ``written`` (the keys its job writes)
        already left the tiers.

        The copier may store (and the memory tier evict) the job's chunks before the record is
        staged here; such an eviction found no record to take along. Once the record is staged,
        an evicted chunk takes it along (:class:`~kvboost_rag.cache.index.CacheIndex`), so one
        look after registering leaves no record without the chunks it was written with.
        """
        self._index.register(record)
        if any(key in written and not self._store.contains(key) for key in record.chunk_keys):
            self._store.delete(self._index.record_key(record))

    def _job(self, outcome: Prefilled, on_read: Callable[[], None] | None) -> WriteJob:
        """A job over ``outcome``'s buffers. Lent host buffers are held by a counted hold whose
        first reference is the job's (released once the copier staged copies of the chunks,
        or when the job fails); a lookup copying a staged view holds them while it copies.
        They go back (``on_read``) when the last reference is released, never while a view of
        them may still be read."""
        if outcome.keys is None or outcome.values is None:
            return WriteJob(release=on_read)
        if on_read is None or self._copies.frees_buffers_at_once:
            return WriteJob(release=on_read, source=(outcome.keys, outcome.values))
        hold = CountedHold(on_read)
        return WriteJob(release=hold.release, source=(outcome.keys, outcome.values), hold=hold, copy=CopyUnderWay())

    def _held_bytes(self, job: WriteJob, outcome: Prefilled) -> int:
        """Bytes ``job`` holds until the copier ran it: its device copies (CUDA), or the
        prompt's buffers, whole (lent or its own: a queued job keeps them all)."""
        if self._copies.frees_buffers_at_once:
            return sum(chunk.nbytes for chunk in job.chunks)
        if not job.chunks:
            return 0
        return _storage_bytes(outcome.keys) + _storage_bytes(outcome.values)

    def write_later(self, key: str, entry: StoredEntry, on_missing: Callable[[], None] | None = None) -> None:
        """Stage ``entry`` (it must own its memory) and put it into the tiers on the writer;
        ``on_missing`` runs there when no tier kept it."""
        self._store.stage(key, entry)
        try:
            self._writer.submit(partial(self._put_staged, key, entry, on_missing), entry.nbytes)
        except BaseException:
            self._store.settle(key, entry)
            raise

    def _plan_prefix(self, plan: PromptPlan, outcome: Prefilled, pin: bool, job: WriteJob) -> None:
        """The chunks of the prompt's leading part that the prefix hit did not serve and no
        tier holds, indexed at once; with ``pin``, every chunk of that part to pin."""
        ids = plan.tokens.ids
        if pin:
            job.pins.extend(outcome.prefix_keys)  # the chunks that hit
        for chunk in plan.stored_prefix_after(outcome.prefix_tokens):
            if chunk.stop <= outcome.prefix_tokens:
                continue  # served by the chunks that hit
            rows = slice(chunk.start, chunk.stop)
            if not self._store.contains(chunk.key):
                job.chunks.append(self._chunk(chunk.key, job, rows, ids[rows], chunk.start))
                job.indexed_prefixes.append(chunk.key)
            self._index.prefixes.add(chunk.parent, chunk.key, ids[rows])
            if pin:
                job.pins.append(chunk.key)

    def _plan_document(self, document: PlacedDocument, outcome: Prefilled, job: WriteJob, whole: bool = False) -> int:
        """The chunks of ``document`` that sit whole in the prompt and that no tier holds (then
        its record is registered); returns their tokens. With ``whole`` (a block of the
        prompt's text), nothing unless every chunk it lacks can be cut from this prompt."""
        record = document.record
        planned = {chunk.key for chunk in job.chunks}
        writes: list[ChunkWrite] = []
        for index, key in enumerate(record.chunk_keys):
            if key in outcome.loaded_chunks or key in planned or self._store.contains(key):
                continue
            first = document.chunk_span(index)
            if first is None:  # not wholly in this prompt, or split by a boundary merge
                if whole:
                    return 0
                continue
            lo, length = index * record.chunk_size, record.chunk_length(index)
            writes.append(self._chunk(key, job, slice(first, first + length), record.token_ids[lo : lo + length], first))
            planned.add(key)
        self._index.note_document(record)
        job.chunks.extend(writes)
        tokens = sum(len(write.token_ids) for write in writes)
        if tokens:
            job.records.append(record)
        return tokens

    @staticmethod
    def _chunk(key: str, job: WriteJob, rows: slice, token_ids, start: int) -> ChunkWrite:
        assert job.source is not None
        keys, values = job.source
        return ChunkWrite(key, keys[:, :, rows], values[:, :, rows], torch.tensor(list(token_ids), dtype=torch.long), start)

    def _stage(self, job: WriteJob) -> None:
        """Gather the chunks (device copies on CUDA) and stage them; unquantized device copies
        go into the device tier as they are."""
        gathered = self._copies.gather([t for chunk in job.chunks for t in (chunk.keys, chunk.values)])
        for i, chunk in enumerate(job.chunks):
            chunk.keys, chunk.values = gathered[2 * i], gathered[2 * i + 1]
            entry = entry_in_place(KVBlock(chunk.keys, chunk.values, chunk.token_ids, chunk.start), fingerprint=self._fingerprint)
            chunk.staged = entry if job.hold is None else LentEntry(entry.tensors, entry.metadata, hold=job.hold, copy=job.copy)
            self._store.stage(chunk.key, chunk.staged)
        if self._on_device and job.chunks:
            self._store.put_device([(chunk.key, chunk.staged) for chunk in job.chunks])

    @property
    def _on_device(self) -> bool:
        """Whether the gathered chunks are device copies the device tier holds as they are."""
        return self._copies.frees_buffers_at_once and self._bits is None and self._store.has_device_tier

    # ------------------------------------------------------------------ the copier
    def _take_copies(self, job: WriteJob) -> None:
        """Copy the job's chunks into memory of the cache's own and stage those copies instead
        of the views, hand the buffers back, then queue the copies for the tiers."""
        try:
            self._copy_and_stage(job)
            job.release_buffers()  # no view of them is staged any more: they go back (or, a warm's own, are freed)
            self._writer.submit(partial(self._store_copies, job), job.owned_bytes)
        except BaseException:
            self._drop(job)  # nothing staged may outlive the buffers it views
            raise

    def _copy_and_stage(self, job: WriteJob) -> None:
        """Copy the job's chunks and stage each copy in place of its view. Views of lent host
        buffers (``job.copy``) go one chunk at a time, in the prompt's order, so a lookup
        waiting for the first chunks reads them while the copier makes the next; other chunks
        go in one batch (on CUDA, one wait for the copies)."""
        progress = job.copy
        if progress is None:
            self._copy_and_stage_group(job, job.chunks)
            return
        progress.start()
        for chunk in job.chunks:
            self._copy_and_stage_group(job, [chunk])
            progress.advance()
        progress.finish()

    def _copy_and_stage_group(self, job: WriteJob, group: list[ChunkWrite]) -> None:
        """Copy ``group``'s chunks (one batch) and stage each copy in place of its view."""
        owned = self._owned(group)
        job.owned.extend(owned)
        for chunk, copy in zip(group, owned):
            self._stage_copy(chunk, copy)
            chunk.let_go()

    def _stage_copy(self, chunk: ChunkWrite, copy: StoredEntry) -> None:
        """What lookups of ``chunk`` find until the tiers hold it: ``copy`` in place of a
        staged view of the prompt's buffers (``chunk.staged`` becomes ``None`` when it was
        deleted or staged anew since: the writer then skips it). A staged device copy owns its
        memory and stays, so lookups keep finding it on the device."""
        if chunk.staged is not None and not self._copies.frees_buffers_at_once:
            chunk.staged = copy if self._store.restage(chunk.key, chunk.staged, copy) else None

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

    # ------------------------------------------------------------------ the writer
    def _store_copies(self, job: WriteJob) -> None:
        """Put every staged copy into the tiers and settle it (a tier that raises for one
        chunk does not keep the others from being tried; the first error is raised after),
        then fix the index, pin, count and charge."""
        stored, failures = 0, []
        try:
            for chunk, entry in zip(job.chunks, job.owned):
                if chunk.staged is None:
                    continue  # deleted (or staged anew) since
                try:
                    stored += self._store.put_staged(chunk.key, chunk.staged, entry, device=not self._on_device)
                except Exception as error:  # noqa: BLE001 - settled; raised once the others are tried
                    failures.append(f"{type(error).__name__}: {error}")  # a message: no traceback keeps the copies
                chunk.staged = None
        finally:
            self._drop(job)  # anything an interruption left staged; the index for what no tier holds
        self._pin_stored(job)
        if stored:
            self._count({"stored_entries": stored})
        self._charge()
        if failures:
            raise TierWriteError(f"{len(failures)} of {len(job.chunks)} chunks: {failures[0]}")

    def _pin_stored(self, job: WriteJob) -> None:
        """Pin ``job``'s pins where a tier holds them."""
        for key in job.pins:
            self._store.pin(key)

    def _drop(self, job: WriteJob) -> None:
        """Unstage what ``job`` staged, drop the prefix chunks indexed for it that no tier
        holds, and hand its buffers back (a failure before the tiers took it)."""
        for chunk in job.chunks:
            if chunk.staged is not None:
                self._store.settle(chunk.key, chunk.staged)
                chunk.staged = None
        for key in job.indexed_prefixes:
            if not self._store.contains(key):
                self._index.prefixes.drop(key)
        if job.copy is not None:
            job.copy.finish()  # nothing of it is staged: lookups waiting for it go on
        job.release_buffers()

    def _put_staged(self, key: str, entry: StoredEntry, on_missing: Callable[[], None] | None) -> None:
        try:
            self._store.put_staged(key, entry, entry)
        finally:
            if on_missing is not None and not self._store.contains(key):
                on_missing()
            self._charge()
