"""Splitting a prompt into a shared beginning, documents and live text.

Documents are known to a :class:`DocumentRegistry` (warmed, or passed by the caller). They
are found in a prompt *string* by an anchor index over their first characters, scanning the
prompt once (time linear in the prompt's length, independent of the corpus size), in any order
and at any offset. The registry indexes; the full records live on a shelf (the cache's tiers
in an engine, see :mod:`kvboost_rag.document_shelf`). A document that lands only partly (a
leading part) still matches that part.

A match is then aligned in token space: the prompt is tokenized once, as full prefill sees
it, and a document token counts as found only where the prompt holds the same token id over
the same characters. Where the tokenizer merged characters across a document boundary the
prompt's tokens differ; those become live tokens (:attr:`DocumentOccurrence.merged_tokens`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvboost_rag.hashing import anchor_hash, content_hash_chain, text_digest

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
        aligned: ``(prompt_token_index, document_token_index)`` pairs whose ids and
            character spans agree.
        merged_tokens: Document tokens inside the matched text with no identical prompt
            token (the tokenizer merged across the boundary, or split differently).
    """

    record: DocumentRecord
    char_start: int
    matched_chars: int
    aligned: list[tuple[int, int]] = field(default_factory=list)
    merged_tokens: int = 0

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
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._count

    @property
    def nbytes(self) -> int:
        """Estimated bytes of the anchor index."""
        return len(self) * ANCHOR_ENTRY_BYTES

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
            digests = self._anchors.setdefault(anchor, [])
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
            return True

    def find(self, prompt: str, explicit: Sequence[DocumentRecord] = (), start: int = 0) -> list[DocumentOccurrence]:
        """Find registered and explicitly given documents in ``prompt``.

        The prompt is scanned once; at each position the anchor hash of the next
        :data:`ANCHOR_CHARS` characters is looked up, and the records of matching anchors are
        read from the shelf (a record no longer kept is dropped from the index).

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
        anchors = self._anchors
        i, end = start, len(prompt) - ANCHOR_CHARS
        while i <= end:
            anchor = anchor_hash(prompt[i : i + ANCHOR_CHARS])
            digests = anchors.get(anchor)
            if not digests:
                i += 1
                continue
            best: DocumentOccurrence | None = None
            for digest in list(digests):
                record = self.shelf.load(anchor, digest)
                if record is None:
                    self.forget(anchor, digest)
                    continue
                matched = common_prefix_length(prompt, i, record.text)
                if matched >= ANCHOR_CHARS and (best is None or matched > best.matched_chars):
                    best = DocumentOccurrence(record, i, matched)
            if best is None:
                i += 1
                continue
            found.append(best)
            i += best.matched_chars
        return _non_overlapping(found)


def _non_overlapping(occurrences: Iterable[DocumentOccurrence]) -> list[DocumentOccurrence]:
    ordered = sorted(occurrences, key=lambda o: (o.char_start, -o.matched_chars))
    kept: list[DocumentOccurrence] = []
    for occ in ordered:
        if kept and occ.char_start < kept[-1].char_start + kept[-1].matched_chars:
            continue
        kept.append(occ)
    return kept


def align_tokens(
    occurrence: DocumentOccurrence,
    prompt_ids: Sequence[int],
    token_at_char: dict[int, int],
    prompt_offsets: Sequence[tuple[int, int]],
) -> None:
    """Fill ``occurrence.aligned`` and ``merged_tokens`` by matching tokens on ids and spans.

    Args:
        occurrence: A document occurrence in the prompt.
        prompt_ids: The prompt's token ids (as full prefill sees them).
        token_at_char: Prompt token index by the character its span starts at.
        prompt_offsets: Character span of each prompt token.
    """
    record = occurrence.record
    base = occurrence.char_start
    aligned: list[tuple[int, int]] = []
    merged = 0
    for k, (x, y) in enumerate(record.offsets):
        if y > occurrence.matched_chars:
            break
        j = token_at_char.get(base + x)
        if aligned and aligned[-1][1] == k - 1 and (j is None or j <= aligned[-1][0]):
            # Several tokens of one character (the bytes of an emoji or a rare letter) share
            # its span: the next token of the document is the next token of the prompt.
            j = aligned[-1][0] + 1 if aligned[-1][0] + 1 < len(prompt_ids) else None
        if j is not None and prompt_offsets[j][1] == base + y and prompt_ids[j] == record.token_ids[k]:
            aligned.append((j, k))
        else:
            merged += 1
    occurrence.aligned = aligned
    occurrence.merged_tokens = merged
