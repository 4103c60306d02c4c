"""A prompt's tokens from the stored tokens of its documents and the text between them.

A document found in a prompt already has its tokens (tokenized alone, kept in its record);
only the text between documents needs tokenizing. The result must be exactly what tokenizing
the whole prompt gives, ids and character spans, so every joint is proven by the tokenizer's
own output:

- each gap between two documents is tokenized together with a few words of each neighbour
  (its *window*, to the :data:`WINDOW_SPACES`-th whitespace character), so the
  gap's tokens see their real context;
- a *joint* between a window and a document is a place where both start a word (a
  pre-token: the pieces the tokenizer cuts text into before tokenizing each alone) with the
  same first token, id and span. Where two tokenizations of the same text both start a word,
  they cut and tokenize the text after it the same way until the texts differ, because the
  supported pre-tokenizers (:mod:`kvboost_rag.request.splice_support`) split left to right
  with nothing looked at behind a word's start and only a character or so ahead;
- on the left of a gap the joint is the last common word start before the document's last
  two words (its end can still change how those are cut), then moved on over every token the
  two agree on: the document's tokens are used before it, the window's after it, so a
  document whose last characters merge with the gap (a "." the pre-tokenizer joins to the
  newlines after it) gives up only its merged tokens;
- on the right the joint is the first common word start before the window's last two words
  (the window's cut end can change those), moved back over every token the two agree on: the
  window's tokens before it, the document's after it (a document alone whose first word is
  tokenized otherwise, a sentencepiece "▁" prepended at a string start, gives up that word);
- a document without joints (too short, or edges of one long word such as a table rule, even
  with windows :data:`WIDER` times wider) is tokenized with the gaps around it; the prompt's
  first and last windows reach its real start and end.

Word starts come from the tokenizer: a window's from its encoding, a document's from the
encoding that made or checked its record.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvboost_rag.request.documents import DocumentOccurrence, DocumentRecord
from kvboost_rag.request.splice_support import SpliceSupport

#: Whitespace characters of a neighbouring document a gap is tokenized with, on each side
#: (about as many words; at most half the document, so two windows into one document never
#: overlap): a joint needs a whole word the window shares with the document, past the
#: window's cut word and the document's (or window's) last two.
WINDOW_SPACES = 5
#: A document whose joints are not found is tried again with windows this many times wider,
#: then tokenized with its gaps.
WIDER = 8
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class KnownDocument:
    """A whole document in a prompt, with where its stored tokens start words.

    Attributes:
        occurrence: Where it sits (``matched_chars == len(record.text)``).
        word_starts: Indices of its tokens that start a word, ascending (from the encoding
            that made or checked its record).
    """

    occurrence: DocumentOccurrence
    word_starts: tuple[int, ...]


class Spliced(NamedTuple):
    """A prompt's tokens, assembled.

    Attributes:
        ids: ``[tokens]`` int64 ids, special tokens included.
        spans: ``[tokens, 2]`` int64 character spans.
        stored: How many of them were taken from document records.
    """

    ids: np.ndarray
    spans: np.ndarray
    stored: int


def splice_tokens(text: str, documents: Sequence[KnownDocument], support: SpliceSupport) -> Spliced:
    """The tokens of ``text`` as tokenizing it whole gives them (special tokens included),
    tokenizing only around ``documents``.

    Args:
        text: The prompt.
        documents: Whole documents in it, in order, not overlapping, each record's tokens
            checked to be its text's.
        support: The tokenizer's splice support.
    """
    kept = list(documents)
    windows = _Windows(text, support)
    while True:
        pieces, failed = _assemble(kept, windows)
        if not failed:
            break
        widened = {id(kept[i]) for i in failed} - windows.wide
        windows.wide |= widened
        kept = [document for i, document in enumerate(kept) if i not in failed or id(document) in widened]
    ids = [np.asarray(support.prefix_ids, dtype=np.int64)] + [p[0] for p in pieces]
    spans = [np.asarray(support.prefix_spans, dtype=np.int64).reshape(-1, 2)] + [p[1] for p in pieces]
    ids.append(np.asarray(support.suffix_ids, dtype=np.int64))
    spans.append(np.asarray(support.suffix_spans, dtype=np.int64).reshape(-1, 2))
    stored = sum(len(piece[0]) for piece in pieces[1::2])  # pieces alternate: window, document rows, ...
    return Spliced(np.concatenate(ids), np.concatenate(spans), stored)


@dataclass(frozen=True)
class _Window:
    """One gap tokenized with its neighbours' edges, spans in prompt characters.

    Attributes:
        start: Its first character in the prompt.
        stop: One past its last.
        ids: Token ids.
        spans: Token spans.
        words: Index of the first token of each word, then the token count.
        word_at: First-token span -> number of each word but its first (the window may cut
            it) and its last two (they may see the cut end).
    """

    start: int
    stop: int
    ids: list[int]
    spans: list[tuple[int, int]]
    words: list[int]
    word_at: dict[tuple[int, int], int]


@dataclass(frozen=True)
class _Joint:
    """Where a window hands over to a document (or back): window token ``at``, record token ``row``."""

    at: int
    row: int


class _Windows:
    """The windows of one prompt, each tokenized once (a retry reuses those it keeps).

    Attributes:
        wide: ``id()`` of the documents whose windows are :data:`WIDER` times wider.
    """

    def __init__(self, text: str, support: SpliceSupport) -> None:
        self.text, self.support = text, support
        self.wide: set[int] = set()
        self._done: dict[tuple[int, int], _Window] = {}
        self._joints: dict[tuple[int, int, Callable], _Joint | None] = {}

    def between(self, left: KnownDocument | None, right: KnownDocument | None) -> _Window:
        """The gap between ``left`` and ``right`` tokenized with the edges of both (the
        prompt's real start and end where there is no document)."""
        start = 0 if left is None else self._tail_start(left.occurrence)
        stop = len(self.text) if right is None else self._head_stop(right.occurrence)
        window = self._done.get((start, stop))
        if window is None:
            window = self._done[start, stop] = self._tokenize(start, stop)
        return window

    def _tokenize(self, start: int, stop: int) -> _Window:
        encoding = self.support.backend.encode(self.text[start:stop], add_special_tokens=False)
        spans = [(x + start, y + start) for x, y in encoding.offsets]
        words = [*word_starts(encoding.word_ids), len(spans)]
        word_at = {spans[words[j]]: j for j in range(1, len(words) - 3)}
        return _Window(start, stop, encoding.ids, spans, words, word_at)

    def joint(
        self, window: _Window, document: KnownDocument, find: Callable[[_Window, KnownDocument], _Joint | None]
    ) -> _Joint | None:
        """``find(window, document)``, found once per window, document and side."""
        key = (id(window), id(document), find)
        if key not in self._joints:
            self._joints[key] = find(window, document)
        return self._joints[key]

    def _reach(self, document: DocumentOccurrence) -> tuple[int, int]:
        """``(whitespace characters, most characters)`` a window reaches into ``document``."""
        return WINDOW_SPACES * (WIDER if id(document) in self.wide else 1), document.matched_chars // 2

    def _tail_start(self, document: DocumentOccurrence) -> int:
        """Where a window into the end of ``document`` starts: on the :meth:`_reach`-th run of
        whitespace before its end (so the window holds its last few words whole), at most half
        the document back."""
        end = document.char_start + document.matched_chars
        spaces, most = self._reach(document)
        for back in (32 * spaces, most):  # most runs are near: look there first
            lowest = end - min(back, most)
            runs = [run.start() for run in _WHITESPACE.finditer(self.text, lowest, end)]
            if len(runs) >= spaces:
                return runs[-spaces]
        return end - most

    def _head_stop(self, document: DocumentOccurrence) -> int:
        """Where a window into the start of ``document`` stops: just past the :meth:`_reach`-th
        run of whitespace after its start, at most half the document on."""
        spaces, most = self._reach(document)
        start = document.char_start
        for ahead in (32 * spaces, most):
            runs = _WHITESPACE.finditer(self.text, start, start + min(ahead, most))
            ends = [run.end() for run in itertools.islice(runs, spaces)]
            if len(ends) == spaces:
                return ends[-1]
        return start + most


def word_starts(word_ids: Sequence[int | None]) -> list[int]:
    """Indices of the tokens that start a word, from an encoding's ``word_ids``."""
    return [i for i, word in enumerate(word_ids) if i == 0 or word is None or word != word_ids[i - 1]]


def _assemble(
    documents: list[KnownDocument], windows: _Windows
) -> tuple[list[tuple[np.ndarray, np.ndarray]], set[int]]:
    """The prompt's pieces in order (window tokens and document rows), and the indices of the
    documents that cannot be joined (empty when the pieces are complete)."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    failed: set[int] = set()
    first_row = 0  # where the current left document's rows start
    for i in range(len(documents) + 1):
        left = documents[i - 1] if i else None
        right = documents[i] if i < len(documents) else None
        window = windows.between(left, right)
        start = 0
        if left is not None:
            joint = windows.joint(window, left, _left_joint)
            if joint is None or joint.row <= first_row:
                failed.add(i - 1)
            else:
                pieces.append(_rows(left.occurrence, first_row, joint.row))
                start = joint.at
        stop = len(window.ids)
        first_row = 0
        if right is not None:
            joint = windows.joint(window, right, _right_joint)
            if joint is None:
                failed.add(i)
            else:
                stop, first_row = joint.at, joint.row
        if stop < start:
            failed.add(i)
        pieces.append(_window_piece(window, start, stop))
    return pieces, failed


def _left_joint(window: _Window, document: KnownDocument) -> _Joint | None:
    """The end of the last clean word the window and the document share before the
    document's last two words (their cut can change with what follows the document), moved on
    over every token they agree on."""
    record, base = document.occurrence.record, document.occurrence.char_start
    words = [*document.word_starts, len(record.token_ids)]
    for j in range(len(words) - 4, -1, -1):
        row, end = words[j], words[j + 1]
        x, y = record.offsets[row]
        if x + base < window.start:
            return None
        at = _shared_word(window, record, base, row, end)
        if at is not None:
            at, row = at + end - row, end
            while row < len(record.token_ids) and at < len(window.ids) and _same(window, at, record, row, base):
                at, row = at + 1, row + 1
            return _Joint(at, row)
    return None


def _right_joint(window: _Window, document: KnownDocument) -> _Joint | None:
    """The start of the first clean word the window and the document share (before the
    window's last two words), moved back over every token they agree on."""
    record, base = document.occurrence.record, document.occurrence.char_start
    words = [*document.word_starts, len(record.token_ids)]
    for j in range(len(words) - 1):
        row, end = words[j], words[j + 1]
        if record.offsets[row][0] + base >= window.stop:
            return None
        at = _shared_word(window, record, base, row, end)
        if at is not None:
            while row > 0 and at > 0 and _same(window, at - 1, record, row - 1, base):
                at, row = at - 1, row - 1
            return _Joint(at, row)
    return None


def _shared_word(window: _Window, record: DocumentRecord, base: int, row: int, end: int) -> int | None:
    """The window's token where the record's word ``[row, end)`` starts, if the window holds
    the same word (same tokens, ids and spans), clean in both; else ``None``."""
    x, y = record.offsets[row]
    word = window.word_at.get((x + base, y + base))
    if word is None:
        return None
    at, stop = window.words[word], window.words[word + 1]
    if stop - at != end - row or not (_clean(window.spans, at, stop) and _clean(record.offsets, row, end)):
        return None
    return at if all(_same(window, at + k, record, row + k, base) for k in range(end - row)) else None


def _clean(spans: Sequence[tuple[int, int]], first: int, stop: int) -> bool:
    """Whether tokens ``[first, stop)`` (one word) cover characters no other token covers:
    the tokens before end where it starts and the tokens after start where it ends (a
    character a tokenizer prepends at a string start, a sentencepiece "▁", shares the span of
    the character after it, so the word it starts is not clean)."""
    start, end = spans[first][0], spans[stop - 1][1]
    before = first == 0 or spans[first - 1][1] <= start
    after = stop == len(spans) or spans[stop][0] >= end
    return start < end and before and after


def _same(window: _Window, at: int, record: DocumentRecord, row: int, base: int) -> bool:
    rx, ry = record.offsets[row]
    return window.ids[at] == record.token_ids[row] and window.spans[at] == (rx + base, ry + base)


def _rows(document: DocumentOccurrence, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Record rows ``[first, stop)`` as ``(ids, spans)`` in prompt characters."""
    record = document.record
    return record.spans[2][first:stop], record.span_pairs[first:stop] + document.char_start


def _window_piece(window: _Window, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(window.ids[start:stop], dtype=np.int64)
    spans = np.asarray(window.spans[start:stop], dtype=np.int64).reshape(-1, 2)
    return ids, spans
