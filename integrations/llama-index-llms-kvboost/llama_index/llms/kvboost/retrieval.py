"""Warming retrieved nodes from LlamaIndex instrumentation (retrieval end events).

Nodes that reach a query but were never prewarmed (inserted without ``KVBoostPrewarmer``,
or evicted since) are queued when a retriever returns them. The answer about to be
generated takes the ones its prompt contains whole and has the engine store them from its own
prefill; the rest are warmed in the background once no answer is running. Either way the
current answer is not delayed, and the next query that retrieves them hits by content hash.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.llms.kvboost.formatting import node_prompt_text

from kvboost_rag.integration import BackgroundWarmer
from kvboost_rag.integration.prewarm import texts_to_warm

if TYPE_CHECKING:
    from llama_index.core.instrumentation.dispatcher import Dispatcher

    from kvboost_rag import KVBoost

logger = logging.getLogger(__name__)


class AnsweringLLM(Protocol):
    """What the retrieval warmer needs of an LLM (``KVBoostLLM`` has it).

    The LLM reports its answers to attached warmers (``answer_started`` / ``claim`` /
    ``answer_finished``), so background warming never competes with an answer.
    """

    @property
    def engine(self) -> KVBoost: ...

    context_window: int

    def attach_background_warmer(self, warmer: BackgroundWarmer) -> None: ...

    def detach_background_warmer(self, warmer: BackgroundWarmer) -> None: ...


class KVBoostRetrievalWarmer(BaseEventHandler):
    """Instrumentation handler that warms retrieved nodes not yet warm, off the answer path.

    Examples:
        ```python
        llm = KVBoostLLM()
        warmer = llm.enable_retrieval_warming()  # or KVBoostRetrievalWarmer(llm=llm).attach()
        response = index.as_query_engine(llm=llm).query("...")
        warmer.detach()
        ```
    """

    idle_seconds: float = Field(
        default=0.5,
        ge=0.0,
        description="Quiet time after the last answer (or retrieval) before background warming starts.",
    )
    max_document_tokens: int = Field(
        gt=0,
        description="Retrieved nodes with more tokens than this are not warmed. Defaults to the LLM's context window.",
    )

    _llm: Any = PrivateAttr()
    _warmer: Any = PrivateAttr()
    _dispatcher: Any = PrivateAttr(default=None)
    _queued: int = PrivateAttr(default=0)

    def __init__(self, llm: AnsweringLLM, idle_seconds: float = 0.5, max_document_tokens: int | None = None) -> None:
        """Build the handler for ``llm`` (not yet attached to a dispatcher).

        Args:
            llm: The ``KVBoostLLM`` whose engine warms the nodes and whose answers are
                watched so warming never competes with them.
            idle_seconds: Quiet time before background warming starts.
            max_document_tokens: Longest node, in model tokens, that is warmed.
        """
        limit = llm.context_window if max_document_tokens is None else max_document_tokens
        super().__init__(idle_seconds=idle_seconds, max_document_tokens=limit)
        self._llm = llm
        self._warmer = BackgroundWarmer(llm.engine, idle_seconds=idle_seconds)
        llm.attach_background_warmer(self._warmer)

    @classmethod
    def class_name(cls) -> str:
        """Class name used in serialization."""
        return "KVBoostRetrievalWarmer"

    @property
    def warmer(self) -> BackgroundWarmer:
        """The background queue (counters ``warmed_documents``, ``claimed_documents``...)."""
        return self._warmer

    @property
    def queued_documents(self) -> int:
        """Retrieved node texts queued so far."""
        return self._queued

    def attach(self, dispatcher: Dispatcher | None = None) -> KVBoostRetrievalWarmer:
        """Register on ``dispatcher`` (default: the root dispatcher, which sees every retriever).

        Returns:
            ``self``.
        """
        target = dispatcher if dispatcher is not None else get_dispatcher()
        if self not in target.event_handlers:
            target.add_event_handler(self)
        self._dispatcher = target
        return self

    def detach(self) -> None:
        """Unregister, stop the background worker and drop what is still queued."""
        if self._dispatcher is not None:
            self._dispatcher.event_handlers = [h for h in self._dispatcher.event_handlers if h is not self]
            self._dispatcher = None
        self._llm.detach_background_warmer(self._warmer)
        self._warmer.close()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until everything queued is warmed or claimed (for tests and scripts)."""
        return self._warmer.wait_idle(timeout)

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        """Queue the not-yet-warm nodes of a ``RetrievalEndEvent``; ignore other events."""
        if not isinstance(event, RetrievalEndEvent):
            return
        try:  # the dispatcher swallows handler errors silently; log them here instead
            texts = [node_prompt_text(scored.node) for scored in event.nodes]
            added = self._warmer.submit(texts_to_warm(self._llm.engine, texts, self.max_document_tokens))
            self._queued += added
            if added:
                logger.debug("queued %d retrieved node(s) for warming", added)
        except Exception:  # noqa: BLE001
            logger.warning("could not queue retrieved nodes for warming", exc_info=True)
