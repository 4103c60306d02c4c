"""Warm the documents a retriever returned, after the answer, so the next query hits.

For corpora that were not prewarmed at ingest: attach ``KVBoostRetrieverWarmer`` to a chain's
callbacks and every document the retriever returns is warmed in a background thread once the
run that retrieved it has finished, so warming never competes with the answer being computed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate

from langchain_kvboost.prewarm import KVBoostPrewarmer

logger = logging.getLogger(__name__)


class KVBoostRetrieverWarmer(BaseCallbackHandler):
    """Callback handler that warms retrieved documents which are not warm yet.

    Documents are queued at ``on_retriever_end`` and warmed by one background thread once the
    outermost run this handler saw around the retriever has ended (the whole chain, when the
    handler is passed in the chain's config). Attached to a retriever alone, it warms as soon
    as the retriever returns.

    Args:
        llm: The ``KVBoostLLM`` / ``ChatKVBoost`` the chain answers with, or its engine.
        document_prompt: How the chain renders each document into the prompt; must match.

    Example:
        .. code-block:: python

            warmer = KVBoostRetrieverWarmer(chat)
            chain.invoke(question, config={"callbacks": [warmer]})
            warmer.wait()   # only needed when you want to be sure it is done
    """

    def __init__(self, llm: Any, *, document_prompt: BasePromptTemplate | str | None = None) -> None:
        self._prewarmer = KVBoostPrewarmer(llm, document_prompt=document_prompt)
        self._lock = threading.Lock()
        self._parents: dict[UUID, UUID | None] = {}
        self._pending: dict[UUID, list[str]] = {}
        self._queue: queue.Queue[list[str] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self.warmed_documents = 0
        """Documents this handler has warmed so far (already-warm ones not counted)."""

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
        self._ended(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
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
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._work, name="kvboost-retriever-warmer", daemon=True
                )
                self._worker.start()
        self._queue.put(texts)

    def _work(self) -> None:
        while True:
            texts = self._queue.get()
            try:
                if texts is None:
                    return
                # Documents already warm are skipped by the engine without computing anything.
                results = self._prewarmer.warm_texts(texts)
                self.warmed_documents += sum(1 for r in results if not r.already_warm)
            except Exception:  # a failed warm must never break the chain that triggered it
                logger.exception("Background warming of %d retrieved documents failed", len(texts or []))
            finally:
                self._queue.task_done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued document has been warmed.

        Args:
            timeout: Seconds to wait at most; ``None`` waits as long as it takes.

        Returns:
            Whether the queue drained in time.
        """
        if timeout is None:
            self._queue.join()
            return True
        done = threading.Event()

        def join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        return done.wait(timeout)

    def close(self) -> None:
        """Finish the queued work and stop the background thread."""
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            worker.join()
