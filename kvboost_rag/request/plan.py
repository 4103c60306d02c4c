"""The plan of one prompt: everything about it that needs no model and no cache.

A :class:`PromptPlan` is built once per prompt, from the prompt text and the tokenizer's
output, before anything is looked up. It holds the token ids and character offsets, the keys
of the prefix grid (the hash chain is walked here, once), where each known document sits and
which of its tokens line up with the prompt's tokens, and where the leading part that may be
stored as exact prefix chunks ends. Lookup, stitching, repair and write-back all read the
plan; none of them tokenizes, hashes or aligns again.

Pure: standard library, NumPy and the pure helpers of :mod:`kvboost_rag.request.hashing` and
:mod:`kvboost_rag.request.documents` only (torch only to hold the token ids as a host tensor).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvboost_rag.request.documents import (
    DocumentOccurrence,
    DocumentRecord,
    DocumentRegistry,
    PromptIndex,
    align_all,
)
from kvboost_rag.request.hashing import prefix_hash


class PromptTokens:
    """A prompt as full prefill sees it.

    Built from lists (``ids``, ``offsets``) or from arrays (:meth:`from_arrays`, what the
    spliced tokenizing builds); each form is made from the other once, when first read.

    Args:
        text: The prompt string.
        ids: Its token ids (special tokens included, as the model reads them).
        offsets: Character span of each token in ``text``.
        found: Documents found in ``text`` while it was tokenized (``None``: not looked for),
            in order, not overlapping; planning reads them instead of looking again.

    Attributes:
        blocks: Digests of the documents among ``found`` that are blocks of the text seen for
            the first time (:mod:`kvboost_rag.request.blocks`): stored by content, they do not
            end the prompt's stored prefix.
    """

    blocks: frozenset[str] = frozenset()

    def __init__(
        self,
        text: str,
        ids: Sequence[int],
        offsets: Sequence[tuple[int, int]],
        found: Sequence[DocumentOccurrence] | None = None,
    ) -> None:
        self.text = text
        self.__dict__["ids"] = list(ids)
        self.__dict__["offsets"] = list(offsets)
        self.found = tuple(found) if found is not None else None

    @classmethod
    def from_arrays(
        cls, text: str, ids: np.ndarray, spans: np.ndarray, found: Sequence[DocumentOccurrence] | None = None
    ) -> PromptTokens:
        """Tokens held as arrays: ``ids`` ``[tokens]`` int64, ``spans`` ``[tokens, 2]`` int64."""
        tokens = cls.__new__(cls)
        tokens.text = text
        tokens.__dict__["id_array"] = np.ascontiguousarray(ids, dtype=np.int64)
        tokens.__dict__["span_array"] = np.ascontiguousarray(spans, dtype=np.int64).reshape(-1, 2)
        tokens.found = tuple(found) if found is not None else None
        return tokens

    def __len__(self) -> int:
        return len(self.id_array) if "id_array" in self.__dict__ else len(self.ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptTokens):
            return NotImplemented
        return self.text == other.text and self.ids == other.ids and self.offsets == other.offsets

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value, compared by content

    def __repr__(self) -> str:
        return f"PromptTokens({len(self)} tokens, {len(self.text)} characters)"

    @functools.cached_property
    def ids(self) -> list[int]:
        """Token ids as a list."""
        return self.id_array.tolist()

    @functools.cached_property
    def offsets(self) -> list[tuple[int, int]]:
        """Character span of each token as a list of ``(start, end)``."""
        spans = self.span_array
        return list(zip(spans[:, 0].tolist(), spans[:, 1].tolist()))

    @functools.cached_property
    def id_array(self) -> np.ndarray:
        """``[tokens]`` int64 token ids."""
        return np.fromiter(self.ids, dtype=np.int64, count=len(self.ids))

    @functools.cached_property
    def span_array(self) -> np.ndarray:
        """``[tokens, 2]`` int64 character spans."""
        offsets = self.offsets
        flat = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
        return flat.reshape(-1, 2)

    @functools.cached_property
    def id_tensor(self) -> torch.Tensor:
        """``[tokens]`` int64 host tensor of :attr:`ids` (built once per prompt)."""
        return torch.from_numpy(self.id_array)


@dataclass(frozen=True)
class PrefixChunk:
    """One piece of the prefix grid: tokens ``[start, stop)`` keyed by the hash chain.

    Attributes:
        key: ``prefix_hash(parent, ids[start:stop])``.
        parent: Key of everything before ``start`` (the chain's root for the first chunk).
        start: First token.
        stop: One past the last token.
    """

    key: str
    parent: str
    start: int
    stop: int

    @property
    def length(self) -> int:
        """Tokens in the chunk."""
        return self.stop - self.start


@dataclass(frozen=True)
class PlacedDocument:
    """A known document at one place in the prompt, aligned token by token.

    Attributes:
        record: The document.
        char_start: Offset of its first character in the prompt.
        first_token: First prompt token that covers any of its characters.
        positions: Prompt positions whose token equals the document's token at ``rows``
            (same id over the same characters), ascending.
        rows: Document token indices paired with ``positions``.
        merged_tokens: Document tokens with no identical prompt token (the tokenizer merged
            characters across the document's boundary).
    """

    record: DocumentRecord
    char_start: int
    first_token: int
    positions: tuple[int, ...]
    rows: tuple[int, ...]
    merged_tokens: int

    def chunk_span(self, chunk: int) -> int | None:
        """First prompt position of document chunk ``chunk`` if all its tokens sit in the
        prompt one after another (so its K/V can be cut from the prompt's); else ``None``."""
        size = self.record.chunk_size
        lo, hi = chunk * size, min((chunk + 1) * size, len(self.record.token_ids))
        i = bisect.bisect_left(self.rows, lo)
        j = i + (hi - lo) - 1
        if j >= len(self.rows) or self.rows[j] != hi - 1:
            return None
        if self.positions[j] - self.positions[i] != hi - lo - 1:
            return None
        return self.positions[i]


@dataclass(frozen=True)
class PromptPlan:
    """Everything downstream needs to know about one prompt before touching the cache.

    Attributes:
        tokens: Ids and offsets.
        root: Root of the prefix hash chain (namespaced by the model fingerprint).
        prefix_chunks: Full grid chunks within ``lookup_limit``, in order: the candidates of
            an exact prefix hit (the last, shorter piece is matched through the cache's
            index of stored chunks under the last hit's key).
        prefix_tail: The short chunk from the last grid point to ``lookup_limit``, found by
            hash when every full chunk hit (a short system prompt stored by another process).
        lookup_limit: A prefix hit covers at most this many tokens (``len - 1`` when the
            last token's logits are needed, ``len`` for a warm).
        documents: Known documents in the prompt, by position, not overlapping.
        shared_end: The leading part ``[0, shared_end)`` is stored as exact prefix chunks
            after prefill: up to the first document (documents are stored by content).
        stored_prefix: The prefix grid over ``[0, shared_end)``, last chunk possibly short.
        reserve: Positions to keep free after the prompt for decoding.
        content_reuse: Whether document K/V may be moved to new positions.
    """

    tokens: PromptTokens
    root: str
    prefix_chunks: tuple[PrefixChunk, ...]
    prefix_tail: PrefixChunk | None
    lookup_limit: int
    documents: tuple[PlacedDocument, ...]
    shared_end: int
    stored_prefix: tuple[PrefixChunk, ...]
    reserve: int
    content_reuse: bool

    @property
    def num_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.tokens.ids)

    @property
    def repeat_hits_all_but_last(self) -> bool:
        """Whether the same prompt asked again, after this one is stored, hits a prefix of every
        token but its last: the whole prompt is stored as prefix chunks (no document found in
        it) and a lookup stops one token short of its end (not a warm, whose every token is
        looked up)."""
        n = self.num_tokens
        return self.lookup_limit == n - 1 and self.shared_end >= n - 1

    def is_new_block(self, document: PlacedDocument) -> bool:
        """Whether ``document`` is one of the prompt's blocks seen for the first time."""
        return document.record.digest in self.tokens.blocks

    def known(self, documents: Iterable[PlacedDocument]) -> list[PlacedDocument]:
        """The documents among ``documents`` known before this prompt (warmed, named or stored
        by an earlier one): all but its new blocks."""
        return [d for d in documents if not self.is_new_block(d)]

    def stored_prefix_after(self, prefix_tokens: int) -> tuple[PrefixChunk, ...]:
        """The prefix chunks to store once a hit served ``prefix_tokens``: :attr:`stored_prefix`,
        or the grid over the whole prompt when the hit passed every known document (a
        conversation going on from an earlier prompt stored whole: its next turn hits this one
        whole, as a prompt with no documents would)."""
        if prefix_tokens <= self.shared_end:
            return self.stored_prefix
        if self.known(self.documents_after(prefix_tokens)):
            return self.stored_prefix
        chunks = list(self.prefix_chunks)
        start, parent = (chunks[-1].stop, chunks[-1].key) if chunks else (0, self.root)
        n = self.num_tokens
        if start < n:
            chunks.append(PrefixChunk(prefix_hash(parent, self.tokens.id_array[start:n]), parent, start, n))
        return tuple(chunks)

    def documents_after(self, position: int) -> list[PlacedDocument]:
        """Documents a prefix hit ending at ``position`` does not wholly cover: those that start
        at or after it, and those it covers in part (a stored beginning that shares a
        document's first tokens, such as a warm's lead-in ending on a document with the same
        first word): their tokens after ``position`` can still be served by content."""
        return [d for d in self.documents if d.first_token >= position or (d.positions and d.positions[-1] >= position)]


def build_plan(
    tokens: PromptTokens,
    *,
    root: str,
    chunk_size: int,
    registry: DocumentRegistry | None,
    explicit: Sequence[DocumentRecord] = (),
    placed: Sequence[DocumentOccurrence] | None = None,
    content_reuse: bool = True,
    lookup_limit: int | None = None,
    reserve: int = 0,
) -> PromptPlan:
    """Plan one prompt.

    Args:
        tokens: The tokenized prompt.
        root: Root of the prefix hash chain.
        chunk_size: Tokens per prefix chunk.
        registry: Known documents to look for in the text; ``None`` looks for none (documents
            found while tokenizing, ``tokens.found``, are read instead of looking again).
        explicit: Documents the caller says are in the prompt (found even when short or not
            registered).
        placed: Document occurrences already known (skips the search).
        content_reuse: Whether documents may be served at new positions. When ``False``
            and no ``placed`` documents are given, no document is looked for and the whole
            prompt is the shared part.
        lookup_limit: Most tokens a prefix hit may cover (default: all but the last).
        reserve: Positions to keep free after the prompt for decoding.
    """
    n = len(tokens.ids)
    limit = n - 1 if lookup_limit is None else min(lookup_limit, n)
    if placed is not None:
        occurrences = list(placed)
    elif content_reuse and tokens.found is not None:
        occurrences = [dataclasses.replace(found) for found in tokens.found]  # aligning fills in fresh copies
    elif content_reuse and (registry is not None or explicit):
        finder = registry if registry is not None else DocumentRegistry()
        occurrences = finder.find(tokens.text, explicit)
    else:
        occurrences = []
    documents = _place(occurrences, tokens)
    shared_end = min((d.first_token for d in documents if d.record.digest not in tokens.blocks), default=n)
    lookup, tail, stored = _prefix_grid(tokens.id_array, root, chunk_size, limit, shared_end)
    return PromptPlan(
        tokens=tokens,
        root=root,
        prefix_chunks=lookup,
        prefix_tail=tail,
        lookup_limit=limit,
        documents=tuple(documents),
        shared_end=shared_end,
        stored_prefix=stored,
        reserve=reserve,
        content_reuse=content_reuse,
    )


def _place(occurrences: Sequence[DocumentOccurrence], tokens: PromptTokens) -> list[PlacedDocument]:
    if not occurrences:
        return []
    index = PromptIndex(len(tokens.text), tokens.id_array, tokens.span_array)
    align_all(occurrences, index)
    placed: list[PlacedDocument] = []
    for occurrence in occurrences:
        placed.append(
            PlacedDocument(
                record=occurrence.record,
                char_start=occurrence.char_start,
                first_token=index.first_token_after(occurrence.char_start),
                positions=occurrence.positions,
                rows=occurrence.rows,
                merged_tokens=occurrence.merged_tokens,
            )
        )
    return placed


def _prefix_grid(
    ids: np.ndarray, root: str, size: int, limit: int, shared_end: int
) -> tuple[tuple[PrefixChunk, ...], PrefixChunk | None, tuple[PrefixChunk, ...]]:
    """Walk the hash chain once: full chunks within ``limit`` (lookup candidates), the short
    chunk that ends exactly at ``limit`` (if ``limit`` is off the grid), and the grid over
    ``[0, shared_end)`` (what write-back stores), sharing every common key."""
    lookup: list[PrefixChunk] = []
    stored: list[PrefixChunk] = []
    tail: PrefixChunk | None = None
    parent, start = root, 0
    end = max(limit, shared_end)
    while start < end:
        stop = start + size
        full = PrefixChunk(prefix_hash(parent, ids[start:stop]), parent, start, stop) if stop <= len(ids) else None
        if full is not None and stop <= limit:
            lookup.append(full)
        elif tail is None and start < limit:
            tail = PrefixChunk(prefix_hash(parent, ids[start:limit]), parent, start, limit)
        if start < shared_end:
            if stop <= shared_end and full is not None:
                stored.append(full)
            else:
                stored.append(PrefixChunk(prefix_hash(parent, ids[start:shared_end]), parent, start, shared_end))
        if full is None:
            break
        parent, start = full.key, stop
    return tuple(lookup), tail, tuple(stored)


class Planner:
    """Plans prompts for one engine: its hash root, chunk size and known documents.

    Args:
        root: Root of the prefix hash chain (from the model fingerprint).
        chunk_size: Tokens per chunk.
        documents: Returns the index of known documents to look for in prompts (read at each
            plan: clearing the cache replaces it).
    """

    def __init__(self, root: str, chunk_size: int, documents: Callable[[], DocumentRegistry]) -> None:
        self.root = root
        self.chunk_size = chunk_size
        self._documents = documents

    def plan(self, tokens: PromptTokens, *, find_documents: bool = True, **options: Any) -> PromptPlan:
        """:func:`build_plan` with this engine's root, chunk size and (unless
        ``find_documents`` is false) known documents; ``options`` are its keyword arguments."""
        registry = self._documents() if find_documents else None
        return build_plan(tokens, root=self.root, chunk_size=self.chunk_size, registry=registry, **options)
