"""Prewarm at ingest: a transform that has the model read every node once.

``KVBoostPrewarmer`` goes last in ``IngestionPipeline(transformations=[...])`` or
``VectorStoreIndex.from_documents(..., transformations=[...])`` (after the splitter). It warms
the exact text a response synthesizer will later put in prompts, so that text is served
from cache by content hash wherever it lands in a prompt and in whatever order.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.schema import BaseNode, TransformComponent
from llama_index.llms.kvboost.formatting import node_prompt_text
from tqdm.auto import tqdm

from kvboost_rag.deprecation import renamed_module_attribute
from kvboost_rag.engine_registry import engine_of

if TYPE_CHECKING:
    from kvboost_rag import KVBoost

logger = logging.getLogger(__name__)

#: Old public names of this module and the names that replaced them.
RENAMED = {"KVBoostPrewarm": "KVBoostPrewarmer"}


def __getattr__(name: str) -> Any:
    return renamed_module_attribute(__name__, name, RENAMED, globals())

#: Node counts from which progress is shown when ``show_progress`` is left unset.
AUTO_PROGRESS_MIN_NODES = 64


class LLMWithEngine(Protocol):
    """What the prewarm transform needs of an LLM (``KVBoostLLM`` has it)."""

    @property
    def engine(self) -> KVBoost: ...

    context_window: int
    max_new_tokens: int


class PrewarmStats(BaseModel):
    """What one prewarm run did.

    Attributes:
        nodes: Nodes received.
        warmed: Distinct node texts whose K/V was computed by this run.
        already_warm: Distinct node texts that were warm before (skipped).
        duplicates: Nodes whose text repeated an earlier node of the same run.
        empty: Nodes with no text (skipped).
        oversized: Nodes longer than ``max_document_tokens`` (skipped, see the log).
        failed: Nodes the engine refused for another reason (see the log).
        new_tokens: Tokens computed.
        elapsed_ms: Wall time of the run.
    """

    nodes: int = 0
    warmed: int = 0
    already_warm: int = 0
    duplicates: int = 0
    empty: int = 0
    oversized: int = 0
    failed: int = 0
    new_tokens: int = 0
    elapsed_ms: float = 0.0


class KVBoostPrewarmer(TransformComponent):
    """Ingest transform that warms each node's prompt text in the KVBoost cache.

    Nodes come back unchanged (same objects, same order). Node texts already warm are
    skipped; empty nodes are skipped; nodes longer than ``max_document_tokens`` are skipped
    with a warning that names the fix (split them smaller before this transform).

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
        if max_document_tokens is not None:
            limit = max_document_tokens
        elif llm is not None:
            limit = llm.context_window - llm.max_new_tokens
        else:
            limit = resolved.context_window
        if limit > resolved.context_window:
            raise ValueError(
                f"max_document_tokens={limit} exceeds the model's context window "
                f"({resolved.context_window}); use at most that"
            )
        super().__init__(model_name=resolved.model_name, max_document_tokens=limit, **kwargs)
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
        started = time.perf_counter()
        stats = PrewarmStats(nodes=len(nodes))
        texts = self._texts_to_warm(nodes, stats)
        show = kwargs.get("show_progress", self.show_progress)
        if show is None:
            show = len(texts) >= AUTO_PROGRESS_MIN_NODES
        # The bar counts nodes (not batches); the engine batches each call through the model.
        with tqdm(total=len(texts), desc="Warming nodes", unit="node", disable=not show) as bar:
            for i in range(0, len(texts), self.batch_size):
                batch = texts[i : i + self.batch_size]
                self._warm_batch(batch, stats)
                bar.update(len(batch))
        stats.elapsed_ms = (time.perf_counter() - started) * 1000.0
        self._last_stats = stats
        logger.info(
            "prewarm: %d nodes, %d warmed (%d tokens), %d already warm, %d empty, %d oversized, %d failed in %.0f ms",
            stats.nodes,
            stats.warmed,
            stats.new_tokens,
            stats.already_warm,
            stats.empty,
            stats.oversized,
            stats.failed,
            stats.elapsed_ms,
        )
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Async version of ``__call__``: the warming runs in a worker thread."""
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)

    def _texts_to_warm(self, nodes: Sequence[BaseNode], stats: PrewarmStats) -> list[str]:
        seen: set[str] = set()
        texts: list[str] = []
        for node in nodes:
            text = node_prompt_text(node)
            if not text:
                stats.empty += 1
                logger.debug("prewarm: node %s has no text; skipped", node.node_id)
                continue
            if text in seen:
                stats.duplicates += 1
                continue
            seen.add(text)
            if self._engine.is_document_warm(text):
                stats.already_warm += 1
                continue
            n_tokens = self._engine.count_tokens(text)
            if n_tokens > self.max_document_tokens:
                stats.oversized += 1
                logger.warning(
                    "prewarm: node %s has %d tokens, more than max_document_tokens=%d; not warmed. "
                    "Split documents smaller before KVBoostPrewarmer (e.g. SentenceSplitter(chunk_size=%d)).",
                    node.node_id,
                    n_tokens,
                    self.max_document_tokens,
                    max(1, self.max_document_tokens // 4),
                )
                continue
            texts.append(text)
        if stats.empty:
            logger.info("prewarm: skipped %d node(s) without text", stats.empty)
        return texts

    def _warm_batch(self, batch: list[str], stats: PrewarmStats) -> None:
        from kvboost_rag import KVBoostError, PromptTooLongError

        try:
            results = self._engine.warm_documents(batch, show_progress=False)
        except KVBoostError as exc:
            if len(batch) > 1:  # isolate the node the engine refused; the others still warm
                for text in batch:
                    self._warm_batch([text], stats)
                return
            if isinstance(exc, PromptTooLongError):
                stats.oversized += 1
                logger.warning(
                    "prewarm: a %d-char node does not fit the model with its warm prefix: %s", len(batch[0]), exc
                )
            else:
                stats.failed += 1
                logger.warning("prewarm: the engine refused a %d-char node: %s", len(batch[0]), exc)
            return
        for result in results:
            if result.already_warm:
                stats.already_warm += 1
            else:
                stats.warmed += 1
                stats.new_tokens += result.new_tokens
