"""Drafts from the prompt's own text: what a RAG answer will likely say next.

An answer quotes its documents and repeats its own phrases. A :class:`Drafter` holds, for one
sequence, the token indexes of the documents its prompt holds (built once per document, when it
was read: :attr:`~kvboost_rag.request.documents.DocumentRecord.ngrams`), of the rest of the
prompt (built here, once, before the first draft) and of the answer so far (grown as tokens are
accepted). Before each decode step it looks up the answer's last tokens in all of them and
proposes the tokens that followed the longest match: the answer so far wins ties, then the
document placed latest in the prompt, then the prompt's other text; within one text, the
latest occurrence. The verify step (:mod:`kvboost_rag.decode.step`) then runs the pending
token and the draft in one forward pass and keeps what the model itself would have chosen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvboost_rag.request.ngrams import GrowingIndex, Match, TokenIndex
from kvboost_rag.request.plan import PromptPlan

#: Most tokens of the answer's end compared with a text (longer matches are not told apart).
LONGEST_MATCH = 8


@dataclass(frozen=True)
class Proposal:
    """Tokens that may come next, and how strongly the texts suggest them.

    Attributes:
        tokens: The continuation found (the caller drafts a prefix of it).
        match_length: How many of the answer's last tokens the text held before them.
        source: ``"answer"``, ``"document"`` or ``"prompt"``.
    """

    tokens: list[int]
    match_length: int
    source: str


class Drafter:
    """Proposes drafts for one sequence from its prompt's texts and its answer so far.

    Args:
        documents: Token indexes of the prompt's documents, the latest placed first.
        prompt: Builds the index of the rest of the prompt (called once, at the first lookup,
            off the path to the first token), or ``None``.
        context: The prompt's last tokens (the answer's first lookups match across its start).
    """

    def __init__(
        self,
        documents: Sequence[TokenIndex],
        prompt: TokenIndex | None,
        context: Sequence[int],
    ) -> None:
        self._documents = list(documents)
        self._prompt = prompt
        self._answer = GrowingIndex()
        self._context: deque[int] = deque((int(t) for t in context[-LONGEST_MATCH:]), maxlen=LONGEST_MATCH)

    def accept(self, tokens: Sequence[int]) -> None:
        """Record tokens the sequence produced (in order)."""
        self._answer.extend(tokens)
        self._context.extend(int(t) for t in tokens)

    def propose(self, limit: int) -> Proposal | None:
        """The continuation of the longest match of the answer's last tokens, at most
        ``limit`` tokens; ``None`` when no text holds the last two tokens followed by more."""
        if limit < 1 or len(self._context) < 2:
            return None
        context = np.fromiter(self._context, dtype=np.int64, count=len(self._context))
        best: tuple[Match, Sequence[int] | np.ndarray, str] | None = None
        candidates: list[tuple[GrowingIndex | TokenIndex, str]] = [(self._answer, "answer")]
        candidates += [(index, "document") for index in self._documents]
        if self._prompt is not None:
            candidates.append((self._prompt, "prompt"))
        for index, source in candidates:
            match = index.find(context, LONGEST_MATCH)
            if match is not None and (best is None or match.length > best[0].length):
                best = (match, index.ids, source)
                if match.length >= LONGEST_MATCH:
                    break
        if best is None:
            return None
        match, ids, source = best
        tokens = [int(t) for t in ids[match.end : match.end + limit]]
        return Proposal(tokens, match.length, source)


def drafter_for(plan: PromptPlan) -> Drafter:
    """A drafter over a planned prompt: its placed documents' stored indexes, and an index of
    its tokens outside them."""
    ids = plan.tokens.ids
    documents = sorted(plan.documents, key=lambda d: d.first_token, reverse=True)
    covered = np.zeros(len(ids), dtype=bool)
    for document in documents:
        covered[list(document.positions)] = True
    live = np.flatnonzero(~covered)
    prompt = TokenIndex(ids, starts=live) if len(live) > 1 else None
    return Drafter([d.record.ngrams for d in documents], prompt, ids)
