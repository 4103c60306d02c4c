"""Text to tokens: the first step of every prompt, document and warmed beginning.

A prompt is tokenized once, but its known documents are not tokenized again: the documents
are found in the text first (:meth:`~kvboost_rag.request.documents.DocumentRegistry.find`),
then only the text between them is tokenized and their stored tokens are spliced in
(:mod:`kvboost_rag.request.splicing`), giving exactly the ids and spans of tokenizing the
whole prompt. A tokenizer splicing does not support is used on the whole prompt.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.errors import InvalidInputError, PromptTooLongError
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.blocks import PromptBlock, prompt_blocks
from kvboost_rag.request.documents import DocumentOccurrence, DocumentRecord, DocumentRegistry, make_record
from kvboost_rag.request.inputs import check_text
from kvboost_rag.request.plan import PromptTokens
from kvboost_rag.request.splice_support import splice_support
from kvboost_rag.request.splicing import KnownDocument, splice_tokens, word_starts

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: Document tokens whose records are remembered as checked (about 100 bytes each).
CHECKED_RECORD_TOKENS = 1 << 18


class CheckedRecords:
    """Records whose tokens are known to be their text's (tokenized here, or checked once),
    with where their tokens start words.

    A record read from a shared store is untrusted: before its tokens stand in for its text
    in a prompt they are compared with tokenizing the text. Bounded, least recently used out.

    Args:
        max_tokens: Budget in document tokens.
    """

    def __init__(self, max_tokens: int = CHECKED_RECORD_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._records: OrderedDict[str, tuple[DocumentRecord, tuple[int, ...]]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def add(self, record: DocumentRecord, word_starts: Sequence[int]) -> None:
        """Remember ``record`` as checked, with the indices of its tokens that start a word."""
        with self._lock:
            if record.digest in self._records:
                self._records.move_to_end(record.digest)
                return
            self._records[record.digest] = (record, tuple(word_starts))
            self._tokens += len(record.token_ids)
            while self._tokens > self.max_tokens and len(self._records) > 1:
                _, (dropped, _) = self._records.popitem(last=False)
                self._tokens -= len(dropped.token_ids)

    def word_starts(self, record: DocumentRecord) -> tuple[int, ...] | None:
        """Where ``record``'s tokens start words if it (or an equal one) was checked, else ``None``."""
        with self._lock:
            known = self._records.get(record.digest)
            if known is None:
                return None
            self._records.move_to_end(record.digest)
        held, starts = known
        same = held is record or (held.token_ids == record.token_ids and held.offsets == record.offsets)
        return starts if same else None


def _special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of a tokenizer's special tokens: its named ones and its added tokens marked
    special (a chat template's role markers are often only the latter)."""
    named = [str(token) for token in getattr(tokenizer, "all_special_tokens", ())]
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return tuple(dict.fromkeys([*named, *(t.content for t in added.values() if getattr(t, "special", False))]))


def _yields_to(occurrence: DocumentOccurrence, block: PromptBlock) -> bool:
    """Whether a found document gives way to ``block``, which it overlaps: the prompt holds
    only a leading part of it, within the block and shorter than it (a document found
    before the block, with more of it outside, stays)."""
    partial = occurrence.matched_chars < len(occurrence.record.text)
    return partial and block.start <= occurrence.char_start and occurrence.char_start + occurrence.matched_chars < block.end


class Tokenizing:
    """Tokenizes text for the engine, the way full prefill sees it.

    Args:
        tokenizer: The model's fast tokenizer.
        model: Anything with a ``context_window`` (the model adapter), read at each prompt so
            it follows the model's config.
        documents: Returns the index of known documents to find in prompts (read at each
            prompt: clearing the cache replaces it); ``None`` finds none.
    """

    def __init__(self, tokenizer: Any, model: Any, documents: Callable[[], DocumentRegistry] | None = None) -> None:
        self.tokenizer = tokenizer
        self._model = model
        self._documents = documents
        #: The texts of the tokenizer's special tokens (a prompt's blocks end at them).
        self.special_tokens = _special_texts(tokenizer)
        self._support, reason = splice_support(tokenizer)
        if self._support is None:
            logger.info("prompts are tokenized whole, documents included: %s", reason)
        self.checked = CheckedRecords()

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def ids_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character spans of ``text`` tokenized alone (no special tokens)."""
        ids, offsets, _ = self._alone(text)
        return ids, offsets

    def record(self, text: str, fingerprint: str, chunk_size: int) -> DocumentRecord:
        """The record of a document, tokenized alone here (so its tokens stand in for its text
        in prompts without a check; see :func:`~kvboost_rag.request.documents.make_record`)."""
        ids, offsets, starts = self._alone(text)
        record = make_record(text, ids, offsets, fingerprint, chunk_size)
        self.checked.add(record, starts)
        return record

    def new_blocks(
        self, text: str, found: Sequence[DocumentOccurrence], registry: DocumentRegistry, fingerprint: str, chunk_size: int
    ) -> tuple[list[DocumentOccurrence], list[DocumentOccurrence]]:
        """Where the blocks of a prompt (:func:`~kvboost_rag.request.blocks.prompt_blocks`) that
        no known or named document ``found`` covers sit, with their records: tokenized here,
        not registered (the write-back registers each once its chunks are stored).

        A known document wins over a block that overlaps it (it is read from cache), unless the
        prompt holds only a leading part of it, within the block and shorter than it: a
        document that opens as the block opens (a shared first sentence) and then goes
        another way. That occurrence is dropped for the block, which the next prompt holding
        it reads whole (its longer match wins there); otherwise the block would never be
        stored, and the prompt would read next to nothing of the document (whole chunks of
        its matched part only).

        Returns:
            ``found`` less the occurrences dropped for blocks, and the blocks' occurrences.
        """
        kept = list(found)
        added: list[DocumentOccurrence] = []
        for block in prompt_blocks(text, self.special_tokens):
            overlapping = [o for o in kept if block.start < o.char_start + o.matched_chars and o.char_start < block.end]
            if any(not _yields_to(o, block) for o in overlapping):
                continue
            if registry.lookup(block.text) is not None:
                continue
            record = self.record(block.text, fingerprint, chunk_size)
            record.ngrams  # noqa: B018 - indexed once, when the block is read: decoding drafts from it
            kept = [o for o in kept if not any(o is dropped for dropped in overlapping)]
            added.append(DocumentOccurrence(record, block.start, len(block.text)))
        return kept, added

    def _alone(self, text: str) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        """``(ids, spans, word starts)`` of ``text`` tokenized alone (no special tokens)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = word_starts(enc.word_ids()) if self._support is not None else []
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]], starts

    def prompt(
        self,
        text: str,
        what: str = "prompt",
        *,
        find: bool = False,
        explicit: Sequence[DocumentRecord] = (),
        blocks_as: tuple[str, int] | None = None,
    ) -> PromptTokens:
        """A prompt's tokens exactly as full prefill sees them (special tokens included).

        Args:
            text: The prompt.
            what: What it is, for errors.
            find: Find known documents (and ``explicit`` ones) in it first: their stored
                tokens are spliced in, and planning reads them from ``found``.
            explicit: Documents the caller says are in the prompt.
            blocks_as: ``(fingerprint, chunk_size)`` to find the text's blocks seen for the
                first time (:meth:`new_blocks`) as ``explicit`` documents are (see
                :attr:`~kvboost_rag.request.plan.PromptTokens.blocks`); ``None``: none.

        Raises:
            InvalidInputError: Blank or unreadable text, or no tokens.
            PromptTooLongError: It does not fit the context window.
        """
        check_text(text, what)
        found, blocks = None, []
        if find:
            with stage("find"):
                registry = self._documents() if self._documents is not None else DocumentRegistry()
                found = registry.find(text, explicit)
                if blocks_as is not None:
                    found, blocks = self.new_blocks(text, found, registry, *blocks_as)
                found = sorted([*found, *blocks], key=lambda o: o.char_start) if blocks else found
        with stage("tokenize"):
            tokens = self._tokens(text, found)
        if blocks:
            tokens.blocks = frozenset(o.record.digest for o in blocks)
        n = len(tokens)
        if not n:
            raise InvalidInputError(f"{what} has no tokens")
        window = self._model.context_window
        if n >= window:
            raise PromptTooLongError(
                f"{what} has {n} tokens but the model's context window is {window}: "
                "retrieve fewer or shorter documents"
            )
        return tokens

    def _tokens(self, text: str, found: list[DocumentOccurrence] | None) -> PromptTokens:
        known = []
        if self._support is not None:
            for occurrence in found or ():
                starts = self._word_starts(occurrence.record) if occurrence.is_whole else None
                if starts:
                    known.append(KnownDocument(occurrence, starts))
        if known:
            ids, spans, _ = splice_tokens(text, known, self._support)
            return PromptTokens.from_arrays(text, ids, spans, found)
        enc = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        return PromptTokens(text, enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]], found)

    def _word_starts(self, record: DocumentRecord) -> tuple[int, ...] | None:
        """Where ``record``'s tokens start words, once its tokens are known to be its text's
        (checked once per record, by tokenizing it); ``None`` when they are not."""
        starts = self.checked.word_starts(record)
        if starts is not None:
            return starts
        ids, offsets, starts = self._alone(record.text)
        if tuple(ids) != record.token_ids or tuple(offsets) != record.offsets:
            _warnings.warning(
                "record-tokens-differ", "a stored document record's tokens are not its text's: its text is tokenized instead"
            )
            return None
        self.checked.add(record, starts)
        return tuple(starts)
