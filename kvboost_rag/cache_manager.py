"""Lookup, storage and counters for cached K/V. Never calls the model.

Two kinds of entries, both cut into ``chunk_size`` pieces and stored through the tier stack:

- prefix chunks, keyed by :func:`~kvboost_rag.hashing.prefix_hash` chains from the prompt's
  first token. Their K/V is exact for any prompt that starts with the same tokens.
- document chunks, keyed by :func:`~kvboost_rag.hashing.content_hash` chains from the
  document's own first token. Their K/V is re-rotated and repaired where reused.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvboost_rag.config import KVBoostSettings
from kvboost_rag.hashing import content_hash_chain, prefix_hash, root_hash, text_digest
from kvboost_rag.kv_codec import CorruptEntryError, KVBlock, decode_block, encode_block
from kvboost_rag.model_adapter import KVLayout
from kvboost_rag.segments import DocumentRecord, DocumentRegistry
from kvboost_rag.storage import TieredStore

logger = logging.getLogger(__name__)

Tokenize = Callable[[str], tuple[list[int], list[tuple[int, int]]]]


@dataclass(frozen=True)
class PrefixPiece:
    """A stored prefix chunk matched by a prompt: use the first ``length`` rows of ``block``."""

    key: str
    start: int
    length: int
    block: KVBlock


class CacheManager:
    """Finds and stores K/V chunks for one model fingerprint.

    Args:
        store: The tier stack.
        fingerprint: Namespace of every key.
        layout: K/V layout of the model (validates loaded entries).
        settings: Engine settings (chunk size, KV bits).
        tokenize: Tokenizes a document alone: ``text -> (ids, char offsets)``.
        device: Where loaded K/V goes.
        dtype: Dtype of loaded K/V.
    """

    def __init__(
        self,
        store: TieredStore,
        fingerprint: str,
        layout: KVLayout,
        settings: KVBoostSettings,
        tokenize: Tokenize,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.layout = layout
        self.settings = settings
        self.registry = DocumentRegistry()
        self._tokenize = tokenize
        self._device, self._dtype = device, dtype
        self._root = root_hash(fingerprint)
        # parent prefix key -> {child key: child tokens}; finds partial (non-grid) chunks
        self._children: dict[str, dict[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ blocks
    def load(self, key: str) -> KVBlock | None:
        """The block stored under ``key``; a corrupt entry is deleted and counts as a miss."""
        entry = self.store.get(key)
        if entry is None:
            return None
        try:
            return decode_block(
                entry,
                fingerprint=self.fingerprint,
                expected_layout=self.layout.as_tuple(),
                device=self._device,
                dtype=self._dtype,
            )
        except CorruptEntryError as exc:
            logger.warning("dropping corrupt cache entry %s: %s", key[:12], exc)
            self.store.delete(key)
            self.count("corrupt_entries")
            return None

    def save(self, key: str, block: KVBlock, *, pinned: bool = False) -> None:
        """Store ``block`` under ``key`` in every tier."""
        entry = encode_block(
            block, fingerprint=self.fingerprint, bits=self.settings.kv_cache_bits, group_size=self.settings.kv_group_size
        )
        self.store.put(key, entry, pinned=pinned)
        self.count("stored_entries")

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a named counter."""
        with self._lock:
            self.counters[name] += amount

    # ------------------------------------------------------------------ prefixes
    def match_prefix(self, ids: Sequence[int], limit: int | None = None) -> list[PrefixPiece]:
        """Longest run of stored prefix chunks matching the start of ``ids``.

        Grid chunks are found by hash (so entries written by another process hit too); the
        last piece may be a shorter stored chunk, or the leading part of one, found through
        the in-process index. Rows of a prefix chunk depend only on the tokens before them,
        so a leading part of a chunk is exact.

        Args:
            ids: The prompt's tokens.
            limit: Match at most this many tokens.
        """
        size = self.settings.chunk_size
        end = len(ids) if limit is None else min(limit, len(ids))
        pieces: list[PrefixPiece] = []
        parent, pos = self._root, 0
        while pos < end:
            if pos + size <= end:
                key = prefix_hash(parent, ids[pos : pos + size])
                block = self.load(key)
                if block is not None:
                    pieces.append(PrefixPiece(key, pos, size, block))
                    parent, pos = key, pos + size
                    continue
            piece = self._partial_prefix(parent, ids, pos, end)
            if piece is not None:
                pieces.append(piece)
            break
        return pieces

    def _partial_prefix(self, parent: str, ids: Sequence[int], pos: int, end: int) -> PrefixPiece | None:
        with self._lock:
            children = list(self._children.get(parent, {}).items())
        best: tuple[int, str] | None = None
        for key, tokens in children:
            length = 0
            limit = min(len(tokens), end - pos)
            while length < limit and tokens[length] == ids[pos + length]:
                length += 1
            if length and (best is None or length > best[0]):
                best = (length, key)
        if best is None:
            return None
        block = self.load(best[1])
        if block is None:
            with self._lock:
                self._children.get(parent, {}).pop(best[1], None)
            return None
        return PrefixPiece(best[1], pos, best[0], block)

    def prefix_chunks(self, ids: Sequence[int], end: int) -> list[tuple[str, int, int]]:
        """``(key, start, stop)`` of the prefix grid over ``ids[:end]``, last chunk possibly short."""
        size = self.settings.chunk_size
        chunks: list[tuple[str, int, int]] = []
        parent = self._root
        for start in range(0, end, size):
            stop = min(start + size, end)
            key = prefix_hash(parent, ids[start:stop])
            chunks.append((key, start, stop))
            parent = key
        return chunks

    def store_prefix(
        self, ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor, end: int, *, pinned: bool = False
    ) -> int:
        """Store the exact K/V of ``ids[:end]`` as prefix chunks; returns tokens newly stored.

        Args:
            ids: The prompt's tokens.
            keys: ``[layers, heads, >=end, dim]`` exact K for the prompt.
            values: Same for V.
            end: Store tokens ``[0, end)``.
            pinned: Keep these chunks resident (shared beginnings).
        """
        stored = 0
        parent = self._root
        for key, start, stop in self.prefix_chunks(ids, end):
            with self._lock:
                self._children.setdefault(parent, {})[key] = tuple(ids[start:stop])
            if pinned or not self.store.contains(key):
                block = KVBlock(
                    keys=keys[:, :, start:stop].clone(),
                    values=values[:, :, start:stop].clone(),
                    token_ids=torch.tensor(ids[start:stop], dtype=torch.long),
                    start_position=start,
                )
                if not self.store.contains(key):
                    stored += stop - start
                self.save(key, block, pinned=pinned)
            parent = key
        return stored

    # ------------------------------------------------------------------ documents
    def document_record(self, text: str, *, register: bool = True) -> DocumentRecord:
        """The registry's record for ``text``, tokenizing it if new.

        Args:
            text: The document.
            register: Add a new record to the registry (so prompts find it); ``False`` only
                builds the record.
        """
        digest = text_digest(text)
        record = self.registry.get(digest)
        if record is not None:
            return record
        ids, offsets = self._tokenize(text)
        size = self.settings.chunk_size
        keys = content_hash_chain(self.fingerprint, (ids[i : i + size] for i in range(0, len(ids), size)))
        record = DocumentRecord(
            digest=digest,
            text=text,
            token_ids=tuple(ids),
            offsets=tuple(offsets),
            chunk_keys=tuple(keys),
            chunk_size=size,
        )
        if register:
            self.registry.register(record)
        return record

    def missing_chunks(self, record: DocumentRecord) -> list[int]:
        """Indices of the document's chunks that no tier holds."""
        return [i for i, key in enumerate(record.chunk_keys) if not self.store.contains(key)]

    def store_document_chunk(self, record: DocumentRecord, chunk: int, keys: torch.Tensor, values: torch.Tensor, start_position: int) -> None:
        """Store chunk ``chunk`` of a document computed at ``start_position``.

        Args:
            record: The document.
            chunk: Chunk index.
            keys: ``[layers, heads, chunk_tokens, dim]``.
            values: Same for V.
            start_position: Position of the chunk's first token when computed.
        """
        size = record.chunk_size
        ids = record.token_ids[chunk * size : (chunk + 1) * size]
        if keys.shape[2] != len(ids):
            raise ValueError(f"chunk {chunk} has {len(ids)} tokens but {keys.shape[2]} K/V rows")
        block = KVBlock(
            keys=keys.clone(), values=values.clone(), token_ids=torch.tensor(ids, dtype=torch.long), start_position=start_position
        )
        self.save(record.chunk_keys[chunk], block)

    def clear(self) -> None:
        """Drop every entry and index."""
        self.store.clear()
        with self._lock:
            self._children.clear()
        self.registry = DocumentRegistry()
