"""Splitting a prompt into a shared beginning, documents and live text.

Documents are known to a :class:`DocumentRegistry` (warmed, or passed by the caller). They
are found in a prompt *string* by an anchor index over their first characters, scanning the
prompt once (time linear in the prompt's length, independent of the corpus size), in any order
and at any offset. A document that lands only partly (a leading part) still matches that part.

A match is then aligned in token space: the prompt is tokenized once, as full prefill sees
it, and a document token counts as found only where the prompt holds the same token id over
the same characters. Where the tokenizer merged characters across a document boundary the
prompt's tokens differ; those become live tokens (:attr:`DocumentOccurrence.merged_tokens`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvboost_rag.hashing import content_hash_chain, text_digest

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

    def chunk_of(self, token_index: int) -> int:
        """Index of the chunk holding document token ``token_index``."""
        return token_index // self.chunk_size


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


class DocumentRegistry:
    """Documents the engine can recognise in prompts, indexed by their first characters."""

    def __init__(self) -> None:
        self._records: dict[str, DocumentRecord] = {}
        self._anchors: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, digest: object) -> bool:
        return digest in self._records

    def get(self, digest: str) -> DocumentRecord | None:
        """The record with this text digest, if registered."""
        return self._records.get(digest)

    def register(self, record: DocumentRecord) -> None:
        """Add a document (idempotent)."""
        with self._lock:
            if record.digest in self._records:
                return
            self._records[record.digest] = record
            if len(record.text) >= ANCHOR_CHARS:
                self._anchors.setdefault(record.text[:ANCHOR_CHARS], []).append(record.digest)

    def find(self, prompt: str, explicit: Sequence[DocumentRecord] = (), start: int = 0) -> list[DocumentOccurrence]:
        """Find registered and explicitly given documents in ``prompt``.

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
        with self._lock:
            anchors = self._anchors
            records = self._records
            i, end = start, len(prompt) - ANCHOR_CHARS
            while i <= end:
                digests = anchors.get(prompt[i : i + ANCHOR_CHARS])
                if not digests:
                    i += 1
                    continue
                best: DocumentOccurrence | None = None
                for digest in digests:
                    record = records[digest]
                    matched = common_prefix_length(prompt, i, record.text)
                    if best is None or matched > best.matched_chars:
                        best = DocumentOccurrence(record, i, matched)
                assert best is not None
                found.append(best)
                i += max(best.matched_chars, 1)
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
        if j is not None and prompt_offsets[j][1] == base + y and prompt_ids[j] == record.token_ids[k]:
            aligned.append((j, k))
        else:
            merged += 1
    occurrence.aligned = aligned
    occurrence.merged_tokens = merged
