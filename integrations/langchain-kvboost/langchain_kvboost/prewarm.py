"""Prewarm documents at index time, so the first query over them already reuses their K/V.

``KVBoostPrewarmer`` reads each document once through the model and stores its K/V. It
renders a document exactly as the chain will show it in the prompt (the chain's
``document_prompt``, ``{page_content}`` by default), because the engine finds a warmed
document in a prompt by its text.

Two ways to put it in an ingest pipeline:

- as a ``BaseDocumentTransformer``: ``prewarmer.transform_documents(docs)`` warms and returns
  the documents unchanged;
- around any ``VectorStore``: ``store = prewarmer.wrap(InMemoryVectorStore(embeddings))``;
  ``add_documents`` / ``add_texts`` (and their async forms) warm, then add.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvboost_rag.integration import call_in_thread
from kvboost_rag.integration.engine_registry import engine_of
from kvboost_rag.integration.prewarm import (
    DEFAULT_BATCH_SIZE,
    PrewarmStats,
    check_max_document_tokens,
    default_max_document_tokens,
    prewarm_texts,
)
from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.embeddings import Embeddings
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from langchain_core.vectorstores import VectorStore

if TYPE_CHECKING:
    from kvboost_rag import WarmResult

logger = logging.getLogger(__name__)

#: What the oversized-document warning tells the user to do.
_SPLIT_HINT = "split documents smaller before KVBoostPrewarmer (e.g. RecursiveCharacterTextSplitter)"

#: The document prompt LangChain's stuff-documents chains use by default.
DEFAULT_DOCUMENT_PROMPT = "{page_content}"


def as_document_prompt(document_prompt: BasePromptTemplate | str | None) -> BasePromptTemplate:
    """A prompt template from a template string, a template, or ``None`` (``{page_content}``)."""
    if document_prompt is None:
        return PromptTemplate.from_template(DEFAULT_DOCUMENT_PROMPT)
    if isinstance(document_prompt, str):
        return PromptTemplate.from_template(document_prompt)
    return document_prompt


class KVBoostPrewarmer(BaseDocumentTransformer):
    """Warms documents in a kvboost engine as they enter the index.

    Empty documents, repeats and documents the engine already holds are skipped; documents
    longer than ``max_document_tokens`` are skipped with a warning naming the fix; the rest are
    warmed in batches of ``batch_size``, and a document the engine refuses fails alone (logged
    and listed in ``last_stats.failures``) while the others of its batch are warmed.

    Args:
        llm: The ``KVBoostLLM`` / ``ChatKVBoost`` the chain answers with, or its
            ``kvboost_rag.KVBoost`` engine.
        document_prompt: How the chain renders each document into the prompt (a template
            string or prompt template over ``page_content`` and metadata keys). Must match the
            chain's, or the warmed text will not be found in the prompt.
        progress_min_documents: Show a progress bar when warming at least this many new
            documents at once.
        max_document_tokens: Longest document, in model tokens, that is warmed. Defaults to
            the model's context window less the LLM's ``max_new_tokens`` (what a prompt can
            hold), or the whole window when built on an engine.
        batch_size: Documents handed to the engine per call.

    Raises:
        ValueError: ``progress_min_documents`` or ``batch_size`` below 1, or
            ``max_document_tokens`` above the model's context window.
        TypeError: ``llm`` neither is nor holds a ``KVBoost``.

    Example:
        .. code-block:: python

            prewarmer = KVBoostPrewarmer(llm)
            store = prewarmer.wrap(InMemoryVectorStore(embeddings))
            store.add_documents(docs)          # warms, then indexes
            prewarmer.last_stats.failures      # documents not warmed, and why
    """

    def __init__(
        self,
        llm: Any,
        *,
        document_prompt: BasePromptTemplate | str | None = None,
        progress_min_documents: int = 32,
        max_document_tokens: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        if progress_min_documents < 1:
            raise ValueError(f"progress_min_documents must be >= 1, got {progress_min_documents}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.engine = engine_of(llm)
        limit = default_max_document_tokens(self.engine, llm) if max_document_tokens is None else max_document_tokens
        self.max_document_tokens = check_max_document_tokens(self.engine, limit)
        self.document_prompt = as_document_prompt(document_prompt)
        self.progress_min_documents = progress_min_documents
        self.batch_size = batch_size
        self.last_stats = PrewarmStats()
        """Counts and failures of the most recent warm."""

    def render(self, documents: Iterable[Document]) -> list[str]:
        """The text each document contributes to a prompt, rendered by ``document_prompt``."""
        return [format_document(doc, self.document_prompt) for doc in documents]

    def warm_texts(self, texts: Sequence[str], labels: Sequence[str] | None = None) -> list[WarmResult]:
        """Warm already-rendered document texts.

        Empty texts, repeats, texts the engine already holds and texts longer than
        ``max_document_tokens`` are skipped; ``last_stats`` counts each kind and lists the
        documents that were not warmed.

        Args:
            texts: Document texts exactly as they will appear in prompts.
            labels: How logs and ``last_stats.failures`` name each text (default
                ``"document <i>"``).

        Returns:
            The engine's ``WarmResult`` of each text it was handed, in first-seen order.
        """
        self.last_stats = prewarm_texts(
            self.engine,
            list(texts),
            labels=labels,
            max_document_tokens=self.max_document_tokens,
            batch_size=self.batch_size,
            progress_min_documents=self.progress_min_documents,
            split_hint=_SPLIT_HINT,
        )
        return list(self.last_stats.results)

    def warm(self, documents: Sequence[Document]) -> list[WarmResult]:
        """Render and warm ``documents``; see :meth:`warm_texts`."""
        return self.warm_texts(self.render(documents), _labels(documents))

    async def awarm(self, documents: Sequence[Document]) -> list[WarmResult]:
        """Like :meth:`warm`, run in a worker thread so the event loop stays free."""
        return await asyncio.to_thread(self.warm, documents)

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        """Warm ``documents`` and return them unchanged."""
        self.warm(documents)
        return documents

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        """Warm ``documents`` off the event loop and return them unchanged."""
        await self.awarm(documents)
        return documents

    def wrap(self, vectorstore: VectorStore) -> PrewarmingVectorStore:
        """A view of ``vectorstore`` whose ``add_*`` methods warm documents before adding."""
        return PrewarmingVectorStore(vectorstore, self)


def _labels(documents: Sequence[Document]) -> list[str]:
    """How logs name each document: its position, and its id or source when it has one."""
    labels = []
    for i, doc in enumerate(documents):
        name = doc.id or doc.metadata.get("source")
        labels.append(f"document {i} ({name})" if name else f"document {i}")
    return labels


def _documents_from_texts(
    texts: Sequence[str], metadatas: Sequence[dict[str, Any]] | None
) -> list[Document]:
    if metadatas is not None and len(metadatas) != len(texts):
        raise ValueError(f"Got {len(texts)} texts but {len(metadatas)} metadatas.")
    return [
        Document(page_content=text, metadata=dict(metadatas[i]) if metadatas else {})
        for i, text in enumerate(texts)
    ]


class PrewarmingVectorStore(VectorStore):
    """A ``VectorStore`` that warms documents in kvboost, then adds them to the store it wraps.

    Searches, deletes and every other attribute go to the wrapped store, so the wrapper can
    stand wherever the store did (``as_retriever()`` included).

    Args:
        vectorstore: The store that indexes and searches.
        prewarmer: Warms the documents as the chain will render them.
    """

    def __init__(self, vectorstore: VectorStore, prewarmer: KVBoostPrewarmer) -> None:
        self.vectorstore = vectorstore
        self.prewarmer = prewarmer

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper: the wrapped store's extras
        # (e.g. InMemoryVectorStore.store, dump).
        if name in {"vectorstore", "prewarmer"}:
            raise AttributeError(name)
        return getattr(self.vectorstore, name)

    @property
    def embeddings(self) -> Embeddings | None:
        return self.vectorstore.embeddings

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        texts = list(texts)
        self.prewarmer.warm(_documents_from_texts(texts, metadatas))
        return self.vectorstore.add_texts(texts, metadatas=metadatas, ids=ids, **kwargs)

    async def aadd_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """:meth:`add_texts` in a worker thread (the warm and the store's add, in order)."""
        return await call_in_thread(self.add_texts, texts, metadatas, ids=ids, **kwargs)

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        self.prewarmer.warm(documents)
        return self.vectorstore.add_documents(documents, **kwargs)

    async def aadd_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """:meth:`add_documents` in a worker thread."""
        return await call_in_thread(self.add_documents, documents, **kwargs)

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        return self.vectorstore.delete(ids, **kwargs)

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        return await self.vectorstore.adelete(ids, **kwargs)

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return self.vectorstore.get_by_ids(ids)

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return await self.vectorstore.aget_by_ids(ids)

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.similarity_search(query, k=k, **kwargs)

    async def asimilarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return await self.vectorstore.asimilarity_search(query, k=k, **kwargs)

    def similarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return self.vectorstore.similarity_search_with_score(*args, **kwargs)

    async def asimilarity_search_with_score(self, *args: Any, **kwargs: Any) -> list[tuple[Document, float]]:
        return await self.vectorstore.asimilarity_search_with_score(*args, **kwargs)

    def similarity_search_with_relevance_scores(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        return self.vectorstore.similarity_search_with_relevance_scores(query, k=k, **kwargs)

    async def asimilarity_search_with_relevance_scores(
        self, query: str, k: int = 4, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        return await self.vectorstore.asimilarity_search_with_relevance_scores(query, k=k, **kwargs)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.similarity_search_by_vector(embedding, k=k, **kwargs)

    async def asimilarity_search_by_vector(
        self, embedding: list[float], k: int = 4, **kwargs: Any
    ) -> list[Document]:
        return await self.vectorstore.asimilarity_search_by_vector(embedding, k=k, **kwargs)

    def max_marginal_relevance_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return self.vectorstore.max_marginal_relevance_search(query, k=k, **kwargs)

    async def amax_marginal_relevance_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return await self.vectorstore.amax_marginal_relevance_search(query, k=k, **kwargs)

    def max_marginal_relevance_search_by_vector(
        self, embedding: list[float], k: int = 4, **kwargs: Any
    ) -> list[Document]:
        return self.vectorstore.max_marginal_relevance_search_by_vector(embedding, k=k, **kwargs)

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self.vectorstore._select_relevance_score_fn()  # noqa: SLF001 - same contract

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict] | None = None,
        *,
        vectorstore_cls: type[VectorStore] | None = None,
        prewarmer: KVBoostPrewarmer | None = None,
        **kwargs: Any,
    ) -> PrewarmingVectorStore:
        """Warm ``texts``, build ``vectorstore_cls.from_texts(...)`` and wrap it.

        Args:
            texts: Texts to index.
            embedding: Embedding model of the new store.
            metadatas: One metadata dict per text.
            vectorstore_cls: The store class to build (required).
            prewarmer: The prewarmer to warm with (required).
            **kwargs: Passed to ``vectorstore_cls.from_texts``.

        Raises:
            ValueError: ``vectorstore_cls`` or ``prewarmer`` is missing.
        """
        if vectorstore_cls is None or prewarmer is None:
            raise ValueError(
                "PrewarmingVectorStore.from_texts needs vectorstore_cls= and prewarmer=; or wrap a "
                "built store: prewarmer.wrap(InMemoryVectorStore(embeddings))."
            )
        prewarmer.warm(_documents_from_texts(texts, metadatas))
        inner = vectorstore_cls.from_texts(texts, embedding, metadatas=metadatas, **kwargs)
        return cls(inner, prewarmer)
