"""Document records stored in the tier stack, so any process over the same store finds them.

A document's record (its text, its tokens when tokenized alone and their character spans) is
stored as an entry beside its K/V chunks, under a key naming the model namespace, the anchor
hash of its first characters and its text digest::

    doc-<namespace: 16 hex>-<anchor: 8 hex>-<digest: 64 hex>

Listing the keys under the namespace rebuilds the anchor index of a fresh process without
reading any entry; a record is read only when a prompt holds its anchor (or its text is
warmed or passed again). The memory tier holds records within ``max_cache_bytes`` and evicts
each with its K/V chunks, as one group (the cache names the groups); disk and Redis keep them
across restarts.

Records read or saved are kept parsed in a small in-process cache (:class:`RecordCache`, bounded
by tokens), so the documents of the prompts being served are not decoded and checked again at
every prompt; a record leaves it when its entry leaves every tier.

Stored entries are untrusted input: the text must have the digest its key names, the tokens
and spans must be well formed (spans ordered and inside the text), and the chunk keys are not
stored but recomputed from the tokens, so an entry cannot point at other K/V. Any violation
raises :class:`~kvboost_rag.cache.codec.CorruptEntryError`, which the shelf turns into a miss.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import partial

import torch

from kvboost_rag.cache.codec import CorruptEntryError
from kvboost_rag.cache.storage import KIND_FIELD, StoredEntry, TieredStore
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.documents import DocumentRecord, anchor_of, make_record
from kvboost_rag.request.hashing import fingerprint_of, text_digest

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

#: ``kind`` metadata of a stored document record.
RECORD_KIND = "document"
_KEY_RE = re.compile(r"^doc-([0-9a-f]{16})-([0-9a-f]{8})-([0-9a-f]{64})$")


def record_to_entry(record: DocumentRecord, fingerprint: str) -> StoredEntry:
    """The stored entry of a document record (chunk keys are left out: they are recomputed)."""
    return StoredEntry(
        tensors={
            "text": torch.frombuffer(bytearray(record.text.encode("utf-8", "surrogatepass")), dtype=torch.uint8),
            "token_ids": torch.tensor(record.token_ids, dtype=torch.int64),
            "offsets": torch.tensor(record.offsets, dtype=torch.int64).reshape(-1, 2),
        },
        metadata={KIND_FIELD: RECORD_KIND, "fingerprint": fingerprint, "digest": record.digest},
    )


def record_from_entry(entry: StoredEntry, fingerprint: str, chunk_size: int) -> DocumentRecord:
    """The record a stored entry holds, after checking it is well formed.

    Args:
        entry: A stored entry (untrusted).
        fingerprint: This model's fingerprint; the entry must carry the same.
        chunk_size: Tokens per chunk (the chunk keys are recomputed with it).

    Raises:
        CorruptEntryError: Wrong kind or fingerprint, a text that does not match its digest,
            missing or malformed tensors, spans out of order or outside the text.
    """
    meta = entry.metadata
    if meta.get(KIND_FIELD) != RECORD_KIND:
        raise CorruptEntryError("not a document record")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptEntryError("document record of another model fingerprint")
    try:
        raw, ids, offsets = entry.tensors["text"], entry.tensors["token_ids"], entry.tensors["offsets"]
    except KeyError as exc:
        raise CorruptEntryError(f"document record lacks tensor {exc.args[0]!r}") from None
    if raw.dtype != torch.uint8 or raw.dim() != 1 or ids.dim() != 1 or offsets.shape != (ids.numel(), 2):
        raise CorruptEntryError("document record tensors have the wrong shapes or dtypes")
    if ids.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise CorruptEntryError("document record tensors have the wrong dtypes")
    try:
        text = bytes(raw.numpy()).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise CorruptEntryError("document record text is not UTF-8") from None
    if text_digest(text) != meta.get("digest"):
        raise CorruptEntryError("document record text does not match its digest")
    spans = offsets.tolist()
    token_ids = ids.tolist()
    if any(t < 0 for t in token_ids):
        raise CorruptEntryError("document record has negative token ids")
    previous = 0
    for x, y in spans:
        if not previous <= x <= y <= len(text):
            raise CorruptEntryError("document record spans are out of order or outside the text")
        previous = x
    return make_record(text, token_ids, [tuple(span) for span in spans], fingerprint, chunk_size)


#: Tokens of parsed records the shelf keeps in process memory (about 100 bytes each).
RECORD_CACHE_TOKENS = 1 << 18


class RecordCache:
    """Parsed records by digest, least recently used first out, at most ``max_tokens`` tokens.

    Args:
        max_tokens: Budget in document tokens.
    """

    def __init__(self, max_tokens: int = RECORD_CACHE_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._records: OrderedDict[str, DocumentRecord] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def get(self, digest: str) -> DocumentRecord | None:
        """The record, marked as used, or ``None``."""
        with self._lock:
            record = self._records.get(digest)
            if record is not None:
                self._records.move_to_end(digest)
            return record

    def put(self, record: DocumentRecord) -> None:
        """Keep ``record``, dropping the least recently used beyond the budget."""
        size = len(record.token_ids)
        if size > self.max_tokens:
            return
        with self._lock:
            if record.digest in self._records:
                self._records.move_to_end(record.digest)
                return
            self._records[record.digest] = record
            self._tokens += size
            while self._tokens > self.max_tokens:
                _, dropped = self._records.popitem(last=False)
                self._tokens -= len(dropped.token_ids)

    def drop(self, digest: str) -> None:
        """Forget a record (its entry left the tiers)."""
        with self._lock:
            record = self._records.pop(digest, None)
            if record is not None:
                self._tokens -= len(record.token_ids)

    def clear(self) -> None:
        """Forget every record."""
        with self._lock:
            self._records.clear()
            self._tokens = 0


class DocumentShelf:
    """Document records kept in a tier stack (a :class:`~kvboost_rag.request.documents.RecordShelf`).

    Args:
        store: The tier stack the K/V chunks live in.
        fingerprint: Model fingerprint (namespace of the keys, checked on every read).
        chunk_size: Tokens per chunk (chunk keys are recomputed with it).
    """

    def __init__(self, store: TieredStore, fingerprint: str, chunk_size: int) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.chunk_size = chunk_size
        # v2: anchors are polynomial hashes (kvboost_rag.request.hashing.anchor_hash); records keyed
        # by the earlier CRC-32 anchors are not read (their K/V chunks still are).
        self.namespace = fingerprint_of(["document-records/v2", fingerprint])[:16]
        self.prefix = f"doc-{self.namespace}-"
        #: Called with every record read or saved (the cache learns which chunks it owns).
        self.on_record: Callable[[DocumentRecord], None] | None = None
        self.parsed = RecordCache()
        #: Writes a record's entry: ``(key, entry, on_missing)``; ``on_missing`` is called when
        #: no tier kept it. Default: a put into the tiers now; the cache's write-back queues it.
        self.write: Callable[[str, StoredEntry, Callable[[], None]], None] = self._put
        store.on_gone(self._gone)

    def _put(self, key: str, entry: StoredEntry, on_missing: Callable[[], None]) -> None:
        self.store.put(key, entry)
        if not self.store.contains(key):
            on_missing()

    def _gone(self, key: str) -> None:
        parsed = self.parse_key(key)
        if parsed is not None:
            self.parsed.drop(parsed[1])

    def key_of(self, anchor: int, digest: str) -> str:
        """Key of the record with this anchor hash and text digest."""
        return f"{self.prefix}{anchor:08x}-{digest}"

    def parse_key(self, key: str) -> tuple[int, str] | None:
        """``(anchor, digest)`` named by a record key of this namespace, else ``None``."""
        match = _KEY_RE.match(key)
        if match is None or match.group(1) != self.namespace:
            return None
        return int(match.group(2), 16), match.group(3)

    def save(self, record: DocumentRecord) -> None:
        """Store ``record`` in every tier (nothing is written when a tier holds it already)."""
        key = self.key_of(anchor_of(record.text), record.digest)
        if self.on_record is not None:
            self.on_record(record)
        if not self.store.contains(key):
            self.write(key, record_to_entry(record, self.fingerprint), partial(self.parsed.drop, record.digest))
        if self.store.contains(key):  # not kept when larger than every budget
            self.parsed.put(record)

    def load(self, anchor: int, digest: str) -> DocumentRecord | None:
        """The stored record, or ``None`` (missing, or corrupt: then it is deleted)."""
        cached = self.parsed.get(digest)
        if cached is not None:
            if self.on_record is not None:
                self.on_record(cached)
            return cached
        key = self.key_of(anchor, digest)
        entry = self.store.get(key)
        if entry is None:
            return None
        try:
            record = record_from_entry(entry, self.fingerprint, self.chunk_size)
        except CorruptEntryError as exc:
            _warnings.warning("corrupt-record", "dropping corrupt document record %s: %s", key[:24], exc)
            self.store.delete(key)
            return None
        if record.digest != digest or anchor_of(record.text) != anchor:
            _warnings.warning("misfiled-record", "dropping document record %s stored under another key", key[:24])
            self.store.delete(key)
            return None
        if self.on_record is not None:
            self.on_record(record)
        self.parsed.put(record)
        return record

    def stored(self) -> Iterator[tuple[int, str]]:
        """``(anchor, digest)`` of every record the tiers hold (reads key names only)."""
        for key in self.store.keys_with_prefix(self.prefix):
            parsed = self.parse_key(key)
            if parsed is not None:
                yield parsed
