"""Splitting a prompt into a shared beginning, documents and live text.

Documents are known to a :class:`DocumentRegistry` (warmed, or passed by the caller). They
are found in a prompt *string* by an anchor index over their first characters: the anchor of
every window of the prompt is computed at once (time linear in the prompt's length, independent
of the corpus size), in any order
and at any offset. The registry indexes; the full records live on a shelf (the cache's tiers
in an engine, see :mod:`kvboost_rag.cache.document_records`). A document that lands only partly (a
leading part) still matches that part.

A match is then aligned in token space: the prompt is tokenized once, as full prefill sees
it, and a document token counts as found only where the prompt holds the same token id over
the same characters. Where the tokenizer merged characters across a document boundary the
prompt's tokens differ; those become live tokens (:attr:`DocumentOccurrence.merged_tokens`).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvboost_rag.request.hashing import (
    anchor_hash,
    content_hash_chain,
    text_digest,
    window_anchors,
)
from kvboost_rag.request.ngrams import TokenIndex

#: Characters of a document's start that index it. Shorter documents are found only when
#: passed explicitly to ``generate(documents=...)``.
ANCHOR_CHARS = 32


@dataclass(frozen=True)
class DocumentRecord:
    """A document as the registry knows it.

    Attributes:
        digest: SHA-256 of the text.
        text: The document text.
        token_ids: Its tokens when tokenized alone (no special tokens).
        offsets: Character span of each token within ``text``.
        chunk_keys: Content hash of each ``chunk_size`` piece, grid from the first token.
        chunk_size: Tokens per chunk.
    """

    digest: str
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]
    chunk_keys: tuple[str, ...]
    chunk_size: int

    def chunk_length(self, chunk: int) -> int:
        """Tokens in chunk ``chunk`` (the last one may be short)."""
        return min(self.chunk_size, len(self.token_ids) - chunk * self.chunk_size)

    @functools.cached_property
    def spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, ends, token_ids)`` as int64 arrays (computed once per record)."""
        spans = np.array(self.offsets, dtype=np.int64).reshape(-1, 2)
        return np.ascontiguousarray(spans[:, 0]), np.ascontiguousarray(spans[:, 1]), np.array(self.token_ids, dtype=np.int64)

    @functools.cached_property
    def ngrams(self) -> TokenIndex:
        """Where each pair of its neighbouring tokens occurs (what decoding drafts from);
        built once per record, when the document is read."""
        return TokenIndex(self.spans[2])

    @functools.cached_property
    def span_pairs(self) -> np.ndarray:
        """``[tokens, 2]`` int64 character spans (computed once per record)."""
        starts, ends, _ = self.spans
        return np.stack([starts, ends], axis=1)

    @functools.cached_property
    def shared_spans(self) -> bool:
        """Whether some tokens share one span (the bytes of one character)."""
        starts = self.spans[0]
        return bool(len(starts) > 1 and (starts[1:] <= starts[:-1]).any())

    def whole_chunks(self, usable: int) -> list[int]:
        """The chunks that lie wholly within the document's first ``usable`` tokens: the ones
        a warm or a prompt that holds only those tokens can store or serve."""
        return [c for c in range(len(self.chunk_keys)) if c * self.chunk_size + self.chunk_length(c) <= usable]


def make_record(
    text: str, token_ids: Sequence[int], offsets: Sequence[tuple[int, int]], fingerprint: str, chunk_size: int
) -> DocumentRecord:
    """The record of a document tokenized alone.

    Args:
        text: The document.
        token_ids: Its tokens (no special tokens).
        offsets: Character span of each token within ``text``.
        fingerprint: Model fingerprint (namespace of the chunk keys).
        chunk_size: Tokens per chunk; the grid starts at the document's first token.
    """
    ids = list(token_ids)
    keys = content_hash_chain(fingerprint, (ids[i : i + chunk_size] for i in range(0, len(ids), chunk_size)))
    return DocumentRecord(
        digest=text_digest(text),
        text=text,
        token_ids=tuple(ids),
        offsets=tuple(tuple(o) for o in offsets),
        chunk_keys=tuple(keys),
        chunk_size=chunk_size,
    )


@dataclass
class DocumentOccurrence:
    """Where a document sits in one prompt.

    Attributes:
        record: The document.
        char_start: Offset of its first character in the prompt.
        matched_chars: How many of its characters the prompt holds (all of them unless the
            prompt carries only a leading part).
        positions: Prompt token indices whose ids and character spans agree with the
            document tokens at ``rows`` (both ascending).
        rows: Document token indices paired with ``positions``.
        merged_tokens: Document tokens inside the matched text with no identical prompt
            token (the tokenizer merged across the boundary, or split differently).
    """

    record: DocumentRecord
    char_start: int
    matched_chars: int
    positions: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    merged_tokens: int = 0

    @property
    def aligned(self) -> list[tuple[int, int]]:
        """``(prompt_token_index, document_token_index)`` pairs."""
        return list(zip(self.positions, self.rows))

    @property
    def is_whole(self) -> bool:
        """Whether the whole document is in the prompt."""
        return self.matched_chars == len(self.record.text)


def common_prefix_length(text: str, start: int, other: str) -> int:
    """Length of the longest common prefix of ``text[start:]`` and ``other``."""
    if text.startswith(other, start):
        return len(other)
    low, high = 0, min(len(other), len(text) - start)
    while low < high:  # invariant: the first `low` characters match
        mid = (low + high + 1) // 2
        if text.startswith(other[low:mid], start + low):
            low = mid
        else:
            high = mid - 1
    return low


class RecordShelf(Protocol):
    """Where a registry keeps its full records (text, tokens, spans)."""

    def save(self, record: DocumentRecord) -> None:
        """Keep ``record``."""

    def load(self, anchor: int, digest: str) -> DocumentRecord | None:
        """The record with this anchor hash and text digest, or ``None`` if not kept."""


class HeldRecords:
    """A shelf in process memory (unbounded; for plans built without a cache)."""

    def __init__(self) -> None:
        self._records: dict[str, DocumentRecord] = {}

    def save(self, record: DocumentRecord) -> None:
        self._records[record.digest] = record

    def load(self, anchor: int, digest: str) -> DocumentRecord | None:
        return self._records.get(digest)


#: Buckets of the anchor index's first-level filter: powers of two, 2 bytes each, about
#: ``BUCKETS_PER_ANCHOR`` per indexed anchor within these bounds.
MIN_ANCHOR_BUCKETS = 1 << 10
MAX_ANCHOR_BUCKETS = 1 << 20
BUCKETS_PER_ANCHOR = 64
#: Estimated bytes of one anchor index entry (dict slot, anchor int, digest string, list).
ANCHOR_ENTRY_BYTES = sys.getsizeof(2**31) + sys.getsizeof("0" * 64) + sys.getsizeof([0]) + 104


def anchor_of(text: str) -> int:
    """The anchor hash of a document (of its first :data:`ANCHOR_CHARS` characters)."""
    return anchor_hash(text[:ANCHOR_CHARS])


class DocumentRegistry:
    """Documents the engine can recognise in prompts, indexed by their first characters.

    The registry holds only the anchor index (anchor hash -> text digests); full records stay
    on a :class:`RecordShelf` and are read when a prompt holds their anchor. With the
    engine's shelf (the cache's tiers) records are bounded by the cache budgets and found by
    any process over the same store; the default shelf keeps them in memory.

    Args:
        shelf: Where records are kept (default: :class:`HeldRecords`).
    """

    def __init__(self, shelf: RecordShelf | None = None) -> None:
        self.shelf: RecordShelf = shelf if shelf is not None else HeldRecords()
        self._anchors: dict[int, list[str]] = {}
        self._sorted_anchors = np.empty(0, dtype=np.int64)  # the keys of _anchors, sorted
        # Anchors per bucket of their low bits: a prompt window whose bucket is empty is no
        # document start (a gather instead of a search for most windows).
        self._buckets = np.zeros(MIN_ANCHOR_BUCKETS, dtype=np.uint16)
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._count

    @property
    def nbytes(self) -> int:
        """Estimated bytes of the anchor index."""
        return len(self) * ANCHOR_ENTRY_BYTES + self._buckets.nbytes

    def known(self) -> list[tuple[int, str]]:
        """``(anchor, digest)`` of every indexed document."""
        with self._lock:
            return [(anchor, digest) for anchor, digests in self._anchors.items() for digest in digests]

    def lookup(self, text: str) -> DocumentRecord | None:
        """The record of ``text`` if the shelf keeps it (indexing it when it is new here,
        for example stored by another process)."""
        digest = text_digest(text)
        anchor = anchor_of(text)
        record = self.shelf.load(anchor, digest)
        if record is not None and record.text == text:
            self.add_known(anchor, digest, len(text))
            return record
        return None

    def register(self, record: DocumentRecord) -> None:
        """Keep a document on the shelf and index it (idempotent)."""
        self.shelf.save(record)
        self.add_known(anchor_of(record.text), record.digest, len(record.text))

    def add_known(self, anchor: int, digest: str, length: int = ANCHOR_CHARS) -> None:
        """Index a document whose record is on the shelf (``length``: its characters; shorter
        documents than :data:`ANCHOR_CHARS` are not indexed)."""
        if length < ANCHOR_CHARS:
            return
        with self._lock:
            digests = self._anchors.get(anchor)
            if digests is None:
                digests = self._anchors[anchor] = []
                at = int(np.searchsorted(self._sorted_anchors, anchor))
                self._sorted_anchors = np.insert(self._sorted_anchors, at, anchor)
                self._count_bucket(anchor, 1)
            if digest not in digests:
                digests.append(digest)
                self._count += 1

    def forget(self, anchor: int, digest: str) -> bool:
        """Drop a document from the index (its record left the shelf); whether it was indexed."""
        with self._lock:
            digests = self._anchors.get(anchor)
            if digests is None or digest not in digests:
                return False
            digests.remove(digest)
            self._count -= 1
            if not digests:
                del self._anchors[anchor]
                at = int(np.searchsorted(self._sorted_anchors, anchor))
                self._sorted_anchors = np.delete(self._sorted_anchors, at)
                self._count_bucket(anchor, -1)
            return True

    def _count_bucket(self, anchor: int, change: int) -> None:  # change: +1 or -1
        """Count an anchor in (or out of) its bucket; the bucket array grows and shrinks with
        the anchors (about :data:`BUCKETS_PER_ANCHOR` buckets each), rebuilt from the sorted
        anchors when it does. Called under the lock."""
        anchors = len(self._sorted_anchors)
        size = len(self._buckets)
        wanted = min(MAX_ANCHOR_BUCKETS, max(MIN_ANCHOR_BUCKETS, 1 << (anchors * BUCKETS_PER_ANCHOR).bit_length()))
        if wanted > size or wanted * 4 < size:
            self._buckets = np.bincount(self._sorted_anchors & (wanted - 1), minlength=wanted).astype(np.uint16)
        elif change > 0:
            self._buckets[anchor & (size - 1)] += 1
        else:
            self._buckets[anchor & (size - 1)] -= 1

    def find(self, prompt: str, explicit: Sequence[DocumentRecord] = (), start: int = 0) -> list[DocumentOccurrence]:
        """Find registered and explicitly given documents in ``prompt``.

        The anchor hash of every :data:`ANCHOR_CHARS`-character window of the prompt is
        computed at once (:func:`~kvboost_rag.request.hashing.window_anchors`) and matched against the
        index's sorted anchors; only matching windows are visited, in order, and the records
        of their anchors read from the shelf (a record no longer kept is dropped from the
        index). A document found is skipped whole.

        Args:
            prompt: The prompt string.
            explicit: Documents the caller says are in the prompt (found even when short or
                not registered).
            start: Ignore text before this character (the exact shared beginning).

        Returns:
            Non-overlapping occurrences sorted by position; where two overlap, the earlier
            (then longer) wins.
        """
        found: list[DocumentOccurrence] = []
        for record in explicit:
            pos = prompt.find(record.text, start) if record.text else -1
            if pos >= 0:
                found.append(DocumentOccurrence(record, pos, len(record.text)))
        i = start
        for position, anchor in self._matching_windows(prompt, start):
            if position < i:
                continue  # inside a document found before
            best: DocumentOccurrence | None = None
            for digest in list(self._anchors.get(anchor, ())):
                record = self.shelf.load(anchor, digest)
                if record is None:
                    self.forget(anchor, digest)
                    continue
                matched = common_prefix_length(prompt, position, record.text)
                if matched >= ANCHOR_CHARS and (best is None or matched > best.matched_chars):
                    best = DocumentOccurrence(record, position, matched)
            if best is not None:
                found.append(best)
                i = position + best.matched_chars
        return _non_overlapping(found)

    def _matching_windows(self, prompt: str, start: int) -> list[tuple[int, int]]:
        """``(position, anchor)`` of the windows from ``start`` whose anchor is indexed."""
        with self._lock:
            known = self._sorted_anchors
            if not len(known):
                return []
            windows = window_anchors(prompt[start:], ANCHOR_CHARS)
            candidates = np.flatnonzero(self._buckets[windows & (len(self._buckets) - 1)])
        anchors = windows[candidates]
        slots = np.minimum(np.searchsorted(known, anchors), len(known) - 1)
        hits = candidates[known[slots] == anchors]
        return list(zip((hits + start).tolist(), windows[hits].tolist()))


def _non_overlapping(occurrences: Iterable[DocumentOccurrence]) -> list[DocumentOccurrence]:
    ordered = sorted(occurrences, key=lambda o: (o.char_start, -o.matched_chars))
    kept: list[DocumentOccurrence] = []
    for occ in ordered:
        if kept and occ.char_start < kept[-1].char_start + kept[-1].matched_chars:
            continue
        kept.append(occ)
    return kept


class PromptIndex:
    """A prompt's tokens as arrays, built once per plan for aligning every document in it.

    Args:
        text_length: Characters in the prompt.
        ids: Its token ids (a sequence or a ``[tokens]`` array).
        offsets: Character span of each token (a sequence of pairs or a ``[tokens, 2]`` array).

    Attributes:
        ids: ``[tokens]`` token ids.
        ends: ``[tokens]`` end character of each token's span.
        token_at_char: ``[chars + 1]``: the first token with a non-empty span starting at each
            character, ``-1`` where none starts.
        running_end: ``[tokens]`` running maximum of the span ends (non-decreasing even where
            special tokens carry empty spans).
    """

    def __init__(
        self, text_length: int, ids: Sequence[int] | np.ndarray, offsets: Sequence[tuple[int, int]] | np.ndarray
    ) -> None:
        if isinstance(offsets, np.ndarray):
            spans = offsets.reshape(-1, 2)
        else:
            spans = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
        self.ids = np.asarray(ids, dtype=np.int64)
        starts, self.ends = spans[:, 0], np.ascontiguousarray(spans[:, 1])
        self.token_at_char = np.full(text_length + 1, -1, dtype=np.int64)
        tokens = np.flatnonzero(self.ends > starts)[::-1]  # reversed: the first token per start wins
        self.token_at_char[starts[tokens]] = tokens
        self.running_end = np.maximum.accumulate(self.ends) if len(self.ends) else self.ends

    def first_token_after(self, char: int) -> int:
        """Index of the first token whose span ends after ``char``."""
        return int(np.searchsorted(self.running_end, char, side="right"))


def align_tokens(occurrence: DocumentOccurrence, prompt: PromptIndex) -> None:
    """Fill ``occurrence.positions``/``rows`` and ``merged_tokens`` by matching tokens on ids and spans.

    A document token is aligned with the prompt token that starts at the same character, ends
    at the same character and has the same id. Several tokens of one character (the bytes of
    an emoji or a rare letter) share its span: the next token of the document is then the
    next token of the prompt. Vectorized over the document's tokens; documents with such
    shared spans, or where no prompt token starts at the token after an aligned one, take the
    token-by-token path.

    Args:
        occurrence: A document occurrence in the prompt.
        prompt: The prompt's token arrays.
    """
    record = occurrence.record
    base = occurrence.char_start
    starts, ends, ids = record.spans
    count = int(np.searchsorted(ends, occurrence.matched_chars, side="right"))  # spans ends are ordered
    j = prompt.token_at_char[base + starts[:count]]
    if record.shared_spans:
        _align_one_by_one(occurrence, prompt, count)
        return
    found = j >= 0
    j = np.where(found, j, 0)
    ok = found & (prompt.ends[j] == base + ends[:count]) & (prompt.ids[j] == ids[:count])
    if (~found[1:] & ok[:-1]).any():  # no prompt token starts where an aligned one's next does
        _align_one_by_one(occurrence, prompt, count)
        return
    rows = np.flatnonzero(ok)
    occurrence.positions, occurrence.rows = tuple(j[rows].tolist()), tuple(rows.tolist())
    occurrence.merged_tokens = count - len(rows)


def align_all(occurrences: Sequence[DocumentOccurrence], prompt: PromptIndex) -> None:
    """:func:`align_tokens` for every occurrence, the vectorized work done once for all of
    them (the same positions, rows and merged counts as aligning each alone)."""
    batch: list[tuple[DocumentOccurrence, int]] = []
    for occurrence in occurrences:
        record = occurrence.record
        count = int(np.searchsorted(record.spans[1], occurrence.matched_chars, side="right"))
        if record.shared_spans:
            _align_one_by_one(occurrence, prompt, count)
        else:
            batch.append((occurrence, count))
    if not batch:
        return
    counts = np.array([count for _, count in batch])
    bases = np.repeat(np.array([occurrence.char_start for occurrence, _ in batch]), counts)
    starts = np.concatenate([o.record.spans[0][:count] for o, count in batch]) + bases
    ends = np.concatenate([o.record.spans[1][:count] for o, count in batch]) + bases
    ids = np.concatenate([o.record.spans[2][:count] for o, count in batch])
    j = prompt.token_at_char[starts]
    found = j >= 0
    j = np.where(found, j, 0)
    ok = found & (prompt.ends[j] == ends) & (prompt.ids[j] == ids)
    firsts = np.concatenate([[0], np.cumsum(counts)])
    # a token aligned, the next one of the same document with no prompt token starting there
    gap = np.zeros(len(ok), dtype=bool)
    gap[:-1] = ~found[1:] & ok[:-1]
    gap[firsts[1:] - 1] = False
    aligned = np.cumsum(np.concatenate([[0], ok]))[firsts]
    broken = np.cumsum(np.concatenate([[0], gap]))[firsts]
    for i, (occurrence, count) in enumerate(batch):
        lo, hi = firsts[i], firsts[i + 1]
        if broken[i + 1] > broken[i]:
            _align_one_by_one(occurrence, prompt, count)
            continue
        merged = count - int(aligned[i + 1] - aligned[i])
        if merged:
            rows = np.flatnonzero(ok[lo:hi])
            occurrence.positions, occurrence.rows = tuple(j[lo:hi][rows].tolist()), tuple(rows.tolist())
        else:  # every token aligned (the usual case)
            occurrence.positions, occurrence.rows = tuple(j[lo:hi].tolist()), tuple(range(count))
        occurrence.merged_tokens = merged


def _align_one_by_one(occurrence: DocumentOccurrence, prompt: PromptIndex, count: int) -> None:
    record = occurrence.record
    base = occurrence.char_start
    last = len(prompt.ids) - 1
    aligned: list[tuple[int, int]] = []
    merged = 0
    for k in range(count):
        x, y = record.offsets[k]
        j: int | None = int(prompt.token_at_char[base + x])
        if j < 0:
            j = None
        if aligned and aligned[-1][1] == k - 1 and (j is None or j <= aligned[-1][0]):
            j = aligned[-1][0] + 1 if aligned[-1][0] < last else None
        if j is not None and int(prompt.ends[j]) == base + y and int(prompt.ids[j]) == record.token_ids[k]:
            aligned.append((j, k))
        else:
            merged += 1
    occurrence.positions, occurrence.rows = tuple(j for j, _ in aligned), tuple(k for _, k in aligned)
    occurrence.merged_tokens = merged
