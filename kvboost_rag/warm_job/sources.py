"""Where a warm job's documents come from: a folder, a JSONL file, a framework's document store.

Every source becomes a list of :class:`SourceDocument` (an id for reports and the text, exactly
as it will appear in prompts). Order is kept: the job warms the first documents first, and
they become the context other documents are warmed behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvboost_rag.errors import InvalidInputError

#: File suffixes read from a folder (others are ignored).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


@dataclass(frozen=True)
class SourceDocument:
    """One document of a corpus.

    Attributes:
        doc_id: Names it in progress and failure reports (a file path, a JSONL ``id`` or line).
        text: Its text, exactly as prompts will hold it.
    """

    doc_id: str
    text: str


def read_folder(folder: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[SourceDocument]:
    """Every text file under ``folder`` (recursively, sorted by path), one document each."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    return [SourceDocument(str(p.relative_to(folder)), p.read_text(encoding="utf-8", errors="replace")) for p in files]


def read_jsonl(path: Path, text_field: str = "text", id_field: str = "id") -> list[SourceDocument]:
    """One document per line of a JSONL file: ``{"id": ..., "text": ...}`` (``id`` optional).

    Raises:
        InvalidInputError: A line that is not a JSON object, or lacks ``text_field``.
    """
    docs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidInputError(f"{path}:{number} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise InvalidInputError(f"{path}:{number} needs a string field {text_field!r} (--text-field names it)")
            docs.append(SourceDocument(str(row.get(id_field, f"line {number}")), row[text_field]))
    return docs


def read_path(path: str | Path, text_field: str = "text") -> list[SourceDocument]:
    """A folder of text files or a ``.jsonl`` file.

    Raises:
        InvalidInputError: Nothing at ``path``, or a file that is not ``.jsonl``.
    """
    path = Path(path)
    if path.is_dir():
        return read_folder(path)
    if path.is_file() and path.suffix.lower() in {".jsonl", ".ndjson"}:
        return read_jsonl(path, text_field)
    if path.is_file():
        raise InvalidInputError(f"{path}: give a folder of text files or a .jsonl file")
    raise InvalidInputError(f"{path}: no such file or folder")


def _text_of(item: Any) -> str | None:
    """The text of a LangChain ``Document`` (``page_content``), a LlamaIndex node
    (``get_content()``/``text``) or a string."""
    if isinstance(item, str):
        return item
    if isinstance(getattr(item, "page_content", None), str):
        return item.page_content
    get_content = getattr(item, "get_content", None)
    if callable(get_content):
        return str(get_content())
    text = getattr(item, "text", None)
    return text if isinstance(text, str) else None


def _items_of(store: Any) -> Iterable[tuple[str, Any]]:
    docs = getattr(store, "docs", None)  # LlamaIndex document stores (SimpleDocumentStore, ...)
    if isinstance(docs, Mapping):
        return docs.items()
    inner = getattr(store, "_dict", None)  # LangChain InMemoryDocstore
    if isinstance(inner, Mapping):
        return inner.items()
    if callable(getattr(store, "yield_keys", None)) and callable(getattr(store, "mget", None)):
        keys = list(store.yield_keys())  # LangChain BaseStore (InMemoryStore, ...)
        return zip(keys, store.mget(keys))
    if isinstance(store, Mapping):
        return store.items()
    if isinstance(store, Iterable) and not isinstance(store, (str, bytes)):
        return ((str(i), item) for i, item in enumerate(store))
    raise InvalidInputError(f"cannot read documents from a {type(store).__name__}")


def read_store(store: Any) -> list[SourceDocument]:
    """Documents of a LangChain or LlamaIndex document store, a mapping id -> document, or
    an iterable of documents or strings.

    Raises:
        InvalidInputError: An unknown kind of store, or an item with no text.
    """
    docs = []
    for doc_id, item in _items_of(store):
        text = _text_of(item)
        if text is None:
            raise InvalidInputError(f"document {doc_id!r} ({type(item).__name__}) has no text")
        docs.append(SourceDocument(str(doc_id), text))
    return docs


def read_source(source: Any, text_field: str = "text") -> list[SourceDocument]:
    """Documents of any supported source: a path (folder or JSONL), a document store, or an
    iterable of :class:`SourceDocument`, documents or strings."""
    if isinstance(source, (str, Path)):
        return read_path(source, text_field)
    if isinstance(source, list) and all(isinstance(d, SourceDocument) for d in source):
        return list(source)
    return read_store(source)
