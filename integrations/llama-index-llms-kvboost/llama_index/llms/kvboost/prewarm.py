"""Prewarm at ingest: a transform that has the model read every node once.

``KVBoostPrewarmer`` goes last in ``IngestionPipeline(transformations=[...])`` or
``VectorStoreIndex.from_documents(..., transformations=[...])`` (after the splitter). It warms
the exact text a response synthesizer will later put in prompts, so that text is served
from cache by content hash wherever it lands in a prompt and in whatever order.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, TransformComponent
from llama_index.llms.kvboost.formatting import node_prompt_text

from kvboost_rag.integration import prewarm as core
from kvboost_rag.integration.engine_registry import engine_of

if TYPE_CHECKING:
    from kvboost_rag import KVBoost

#: Node counts from which progress is shown when ``show_progress`` is left unset.
AUTO_PROGRESS_MIN_NODES = core.DEFAULT_PROGRESS_MIN_DOCUMENTS

#: What the oversized-node warning tells the user to do.
_SPLIT_HINT = "split documents smaller before KVBoostPrewarmer (e.g. SentenceSplitter(chunk_size=...))"


class LLMWithEngine(Protocol):
    """What the prewarm transform needs of an LLM (``KVBoostLLM`` has it)."""

    @property
    def engine(self) -> KVBoost: ...

    context_window: int
    max_new_tokens: int


class PrewarmStats(core.PrewarmStats):
    """What one prewarm run did (``kvboost_rag.integration.PrewarmStats``, counted in nodes).

    ``nodes`` is the number of nodes received (``documents``); ``failures`` names each node
    not warmed (``"node <id>"``) and why.
    """

    @property
    def nodes(self) -> int:
        """Nodes received."""
        return self.documents


class KVBoostPrewarmer(TransformComponent):
    """Ingest transform that warms each node's prompt text in the KVBoost cache.

    Nodes come back unchanged (same objects, same order). Node texts already warm are
    skipped; empty nodes are skipped; nodes longer than ``max_document_tokens`` are skipped
    with a warning that names the fix (split them smaller before this transform). The rest
    are warmed ``batch_size`` at a time; a node the engine refuses fails alone (a warning,
    and an entry in ``last_stats.failures``) while the others of its batch are warmed. The
    same prewarming as the LangChain ``KVBoostPrewarmer`` (``kvboost_rag.integration.prewarm``).

    Examples:
        ```python
        from llama_index.core import VectorStoreIndex
        from llama_index.core.node_parser import SentenceSplitter
        from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer

        llm = KVBoostLLM()
        index = VectorStoreIndex.from_documents(
            documents,
            transformations=[SentenceSplitter(chunk_size=256), KVBoostPrewarmer(llm=llm)],
        )
        ```
    """

    model_name: str = Field(description="Model whose cache the nodes are warmed in.")
    max_document_tokens: int = Field(
        gt=0,
        description=(
            "Nodes with more tokens than this are not warmed (a warning says so). Defaults to "
            "the LLM's context window minus its max_new_tokens (the most a prompt can hold), or "
            "the model's context window when built on an engine."
        ),
    )
    batch_size: int = Field(
        default=16,
        gt=0,
        description=(
            "Node texts handed to the engine per call (the engine runs several through the model "
            "per forward pass, up to its warm_batch_tokens setting)."
        ),
    )
    show_progress: bool | None = Field(
        default=None,
        description=(
            "Show a progress bar. None shows one from "
            f"{AUTO_PROGRESS_MIN_NODES} nodes up; the call's show_progress keyword wins."
        ),
    )
    instance_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex,
        description=(
            "Distinguishes this transform in IngestionPipeline cache keys, so a cached pipeline "
            "run never skips warming a fresh engine."
        ),
    )

    _engine: Any = PrivateAttr()
    _last_stats: PrewarmStats = PrivateAttr(default_factory=PrewarmStats)

    def __init__(
        self,
        llm: LLMWithEngine | None = None,
        engine: KVBoost | None = None,
        max_document_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Build the transform on an LLM's engine or on an engine.

        Args:
            llm: A ``KVBoostLLM``; its engine is used.
            engine: A ``KVBoost`` engine (instead of ``llm``).
            max_document_tokens: Longest node, in model tokens, that is warmed.
            **kwargs: Other fields (``batch_size``, ``show_progress``).

        Raises:
            ValueError: Neither or both of ``llm`` and ``engine`` given, or
                ``max_document_tokens`` above the model's context window.
            TypeError: ``engine`` is not a ``KVBoost`` (or ``llm`` holds none).
        """
        if (llm is None) == (engine is None):
            raise ValueError("KVBoostPrewarmer needs exactly one of llm= (a KVBoostLLM) or engine= (a KVBoost)")
        resolved = engine_of(engine if engine is not None else llm)
        limit = core.default_max_document_tokens(resolved, llm) if max_document_tokens is None else max_document_tokens
        super().__init__(
            model_name=resolved.model_name,
            max_document_tokens=core.check_max_document_tokens(resolved, limit),
            **kwargs,
        )
        self._engine = resolved
        self._last_stats = PrewarmStats()

    @classmethod
    def class_name(cls) -> str:
        """Class name used in serialization."""
        return "KVBoostPrewarmer"

    @property
    def engine(self) -> KVBoost:
        """The engine nodes are warmed in."""
        return self._engine

    @property
    def last_stats(self) -> PrewarmStats:
        """Counters of the most recent run."""
        return self._last_stats

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Warm the nodes' prompt texts and return the nodes unchanged.

        Args:
            nodes: Nodes from the previous transform.
            **kwargs: ``show_progress`` is honoured; other pipeline keywords are ignored.

        Returns:
            ``nodes``, untouched.
        """
        stats = core.prewarm_texts(
            self._engine,
            [node_prompt_text(node) for node in nodes],
            labels=[f"node {node.node_id}" for node in nodes],
            max_document_tokens=self.max_document_tokens,
            batch_size=self.batch_size,
            show_progress=kwargs.get("show_progress", self.show_progress),
            progress_min_documents=AUTO_PROGRESS_MIN_NODES,
            progress_unit="node",
            split_hint=_SPLIT_HINT,
        )
        self._last_stats = PrewarmStats(**dict(stats))
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Async version of ``__call__``: the warming runs in a worker thread."""
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
