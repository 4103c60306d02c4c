"""Where a run of tokens occurs in a text's token ids: the index drafting reads.

Decoding drafts the tokens that followed the answer's last few tokens wherever those tokens
occur in the prompt's documents, its other text, or the answer so far
(:mod:`kvboost_rag.decode.drafting`). :class:`TokenIndex` answers "where do these tokens occur
in this text" for one token sequence: every pair of neighbouring ids is keyed once, the keys
sorted (NumPy, linear-logarithmic in the text's length, a millisecond for a few thousand
tokens), and a lookup is a binary search plus a comparison of the tokens before each
candidate. A document's index is built once, when the document is read (it is kept with its
:class:`~kvboost_rag.request.documents.DocumentRecord`); the rest of a prompt is indexed at plan
time.

Pure: NumPy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Token ids are keyed in pairs as ``first * KEY_BASE + second``: every vocabulary up to 2**31
#: ids fits an int64 key.
KEY_BASE = 2**31


@dataclass(frozen=True)
class Match:
    """The best place a context's last tokens occur in one text.

    Attributes:
        length: How many of the context's last tokens the text holds there (at least 2).
        end: Index in the text just past the matched tokens (its continuation starts here).
    """

    length: int
    end: int


class TokenIndex:
    """Occurrences of every pair of neighbouring tokens of one token sequence.

    Args:
        ids: The token ids.
        starts: Only pairs starting at these indices are indexed (default: all). A prompt's
            own text is indexed without the spans its documents' indexes already cover.
    """

    __slots__ = ("ids", "_keys", "_starts")

    def __init__(self, ids: Sequence[int] | np.ndarray, starts: np.ndarray | None = None) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        if starts is None:
            starts = np.arange(max(0, len(self.ids) - 1), dtype=np.int64)
        else:
            starts = np.asarray(starts, dtype=np.int64)
            starts = starts[starts < len(self.ids) - 1]
        keys = self.ids[starts] * KEY_BASE + self.ids[starts + 1]
        order = np.argsort(keys, kind="stable")  # equal keys stay in text order
        self._keys = keys[order]
        self._starts = starts[order]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (ids, keys, positions)."""
        return int(self.ids.nbytes + self._keys.nbytes + self._starts.nbytes)

    def find(self, context: np.ndarray, longest: int) -> Match | None:
        """Where the text holds the longest run of ``context``'s last tokens (at least its last
        two, at most ``longest``) followed by at least one more token; among equally long
        runs, the last one in the text.

        Args:
            context: ``[n]`` int64 token ids, ``n >= 2``, the most recent last.
            longest: Most tokens of the context compared.
        """
        key = int(context[-2]) * KEY_BASE + int(context[-1])
        lo, hi = np.searchsorted(self._keys, [key, key + 1])
        if lo == hi:
            return None
        starts = self._starts[lo:hi]
        ends = starts + 2
        usable = ends < len(self.ids)  # a continuation follows
        starts, ends = starts[usable], ends[usable]
        if not len(starts):
            return None
        lengths = np.full(len(starts), 2, dtype=np.int64)
        alive = np.ones(len(starts), dtype=bool)
        for back in range(3, min(longest, len(context)) + 1):
            before = starts - (back - 2)
            alive &= before >= 0
            alive[alive] &= self.ids[before[alive]] == context[-back]
            if not alive.any():
                break
            lengths += alive
        best = int(lengths.max())
        last = int(np.flatnonzero(lengths == best)[-1])  # the latest of the longest
        return Match(best, int(ends[last]))


class GrowingIndex:
    """A :class:`TokenIndex` of a sequence that grows at its end (the answer so far): a dict
    from each pair of neighbouring tokens to where it starts, updated as tokens come."""

    __slots__ = ("ids", "_pairs")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._pairs: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens."""
        for token in tokens:
            if self.ids:
                self._pairs.setdefault((self.ids[-1], token), []).append(len(self.ids) - 1)
            self.ids.append(int(token))

    def find(self, context: np.ndarray, longest: int) -> Match | None:
        """As :meth:`TokenIndex.find`; a match may not end at the sequence's last token (its
        continuation would be empty)."""
        starts = self._pairs.get((int(context[-2]), int(context[-1])))
        if not starts:
            return None
        ids = self.ids
        best: Match | None = None
        for start in reversed(starts):  # latest first: it wins ties
            end = start + 2
            if end >= len(ids):
                continue
            length = 2
            while length < longest and length < len(context) and start - (length - 1) >= 0:
                if ids[start - (length - 1)] != context[-(length + 1)]:
                    break
                length += 1
            if best is None or length > best.length:
                best = Match(length, end)
        return best
