"""Warm the documents a retriever returned, after the answer, so the next query hits.

For corpora that were not prewarmed at ingest: attach ``KVBoostRetrievalWarmer`` to a chain's
callbacks and every document the retriever returns is queued once the run that retrieved it
has finished. The queue is a ``kvboost_rag.warming.background.BackgroundWarmer`` (the one the
LlamaIndex integration uses too): it warms on a worker thread only while no answer this
handler sees is running, one document at a time, so warming never competes with an answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from kvboost_rag.integration import BackgroundWarmer
from kvboost_rag.integration.prewarm import texts_to_warm
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate

from langchain_kvboost.prewarm import KVBoostPrewarmer

logger = logging.getLogger(__name__)

class KVBoostRetrievalWarmer(BaseCallbackHandler):
    """Callback handler that warms retrieved documents which are not warm yet.

    Documents are queued at ``on_retriever_end`` and handed to a background warmer once the
    outermost run this handler saw around the retriever has ended (the whole chain, when the
    handler is passed in the chain's config). Attached to a retriever alone, it queues them as
    soon as the retriever returns. The warmer starts once no LLM run this handler sees is in
    flight and none has been for ``idle_seconds``.

    Args:
        llm: The ``KVBoostLLM`` / ``ChatKVBoost`` the chain answers with, or its engine.
        document_prompt: How the chain renders each document into the prompt; must match.
        idle_seconds: Quiet time after the last answer (or retrieval) before warming starts.
        max_pending: Most documents queued; the oldest are dropped beyond it.
        max_document_tokens: Longest document, in model tokens, that is warmed (documents the
            engine already holds are not queued either). Defaults as ``KVBoostPrewarmer``'s.

    Example:
        .. code-block:: python

            warmer = KVBoostRetrievalWarmer(chat)
            chain.invoke(question, config={"callbacks": [warmer]})
            warmer.wait_idle()   # only needed when you want to be sure it is done
    """

    def __init__(
        self,
        llm: Any,
        *,
        document_prompt: BasePromptTemplate | str | None = None,
        idle_seconds: float = 0.5,
        max_pending: int = 4096,
        max_document_tokens: int | None = None,
    ) -> None:
        self._prewarmer = KVBoostPrewarmer(llm, document_prompt=document_prompt, max_document_tokens=max_document_tokens)
        self._warmer = BackgroundWarmer(self._prewarmer.engine, idle_seconds=idle_seconds, max_pending=max_pending)
        self._lock = threading.Lock()
        self._parents: dict[UUID, UUID | None] = {}
        self._pending: dict[UUID, list[str]] = {}
        self._answers: set[UUID] = set()
        self._queued = 0

    @property
    def warmer(self) -> BackgroundWarmer:
        """The background queue (counters ``warmed_documents``, ``failed_documents``...)."""
        return self._warmer

    @property
    def warmed_documents(self) -> int:
        """Documents this handler has warmed so far (already-warm ones not counted)."""
        return self._warmer.warmed_documents

    @property
    def queued_documents(self) -> int:
        """Retrieved document texts queued so far."""
        return self._queued

    # -- run tree -------------------------------------------------------------------------

    def _started(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._parents[run_id] = parent_run_id

    def _root_of(self, run_id: UUID) -> UUID:
        """Outermost run seen by this handler that encloses ``run_id``. Caller holds the lock."""
        root = run_id
        parent = self._parents.get(root)
        while parent is not None and parent in self._parents:
            root = parent
            parent = self._parents.get(root)
        return root

    def _ended(self, run_id: UUID) -> None:
        with self._lock:
            self._parents.pop(run_id, None)
            texts = self._pending.pop(run_id, None)
        if texts:
            self._enqueue(texts)

    def on_chain_start(
        self,
        serialized: Any,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._started(run_id, parent_run_id)

    def _answer_started(self, run_id: UUID) -> None:
        with self._lock:
            if run_id in self._answers:
                return
            self._answers.add(run_id)
        self._warmer.answer_started()

    def _answer_finished(self, run_id: UUID) -> None:
        with self._lock:
            if run_id not in self._answers:
                return
            self._answers.discard(run_id)
        self._warmer.answer_finished()

    def on_llm_start(
        self,
        serialized: Any,
        prompts: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._started(run_id, parent_run_id)
        self._answer_started(run_id)

    def on_chat_model_start(
        self,
        serialized: Any,
        messages: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._started(run_id, parent_run_id)
        self._answer_started(run_id)

    def on_retriever_start(
        self,
        serialized: Any,
        query: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._started(run_id, parent_run_id)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._ended(run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._ended(run_id)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._answer_finished(run_id)
        self._ended(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._answer_finished(run_id)
        self._ended(run_id)

    def on_retriever_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._ended(run_id)

    def on_retriever_end(
        self,
        documents: Sequence[Document],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        """Queue the retrieved documents for warming once the enclosing run has ended."""
        texts = [text for text in self._prewarmer.render(documents) if text.strip()]
        with self._lock:
            self._parents.setdefault(run_id, parent_run_id)
            root = self._root_of(run_id)
            self._parents.pop(run_id, None)
            if root != run_id and texts:
                self._pending.setdefault(root, []).extend(texts)
                return
        if texts:
            self._enqueue(texts)

    # -- background warming ---------------------------------------------------------------

    def _enqueue(self, texts: list[str]) -> None:
        added = self._warmer.submit(texts_to_warm(self._prewarmer.engine, texts, self._prewarmer.max_document_tokens))
        with self._lock:
            self._queued += added
        if added:
            logger.debug("queued %d retrieved document(s) for warming", added)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued document has been warmed.

        Args:
            timeout: Seconds to wait at most; ``None`` waits as long as it takes.

        Returns:
            Whether the queue drained in time.
        """
        return self._warmer.wait_idle(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued work and stop the background thread; later retrievals are ignored.

        Args:
            timeout: Seconds to wait at most; ``None`` waits as long as it takes.
        """
        self._warmer.close(timeout=timeout, drain=True)
