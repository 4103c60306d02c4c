"""A warm worker: loads the model once, then warms batches of documents into the shared store.

The same class runs in the job's own process (no Ray) and as a Ray actor (one per worker,
each with its model, on a GPU where Ray has them).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvboost_rag.warm_job.report import BatchOutcome, DocumentFailure
from kvboost_rag.warm_job.sources import SourceDocument

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """How each worker builds its engine (picklable, so it travels to Ray actors).

    Attributes:
        model: A local model folder, or ``None`` for the embedded default model.
        settings: :class:`~kvboost_rag.config.KVBoostSettings` fields; they must name the
            shared store the serving replicas use (``redis_url``, or a ``disk_cache_dir`` on
            shared storage) and the same model settings (``kv_cache_bits``, ``warm_prefix``,
            ``chunk_size``...), so the cache namespace matches.
        factory: ``"module:function"`` building the engine instead, called with the settings
            as keyword arguments (for models that need loading code of their own).
        threads: torch CPU threads per worker (``None`` keeps torch's default).
    """

    model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    factory: str | None = None
    threads: int | None = None

    def build(self) -> Any:
        """Load the model and wrap it (in the calling process)."""
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        settings = {"show_progress": False, **self.settings}
        if self.factory is not None:
            return load_factory(self.factory)(**settings)
        from kvboost_rag import KVBoost

        return KVBoost.from_pretrained(self.model, **settings)


def load_factory(path: str) -> Callable[..., Any]:
    """The callable ``"module:function"`` names.

    Raises:
        ValueError: Not of that form, or nothing callable there.
    """
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"an engine factory is 'module:function', got {path!r}")
    target = getattr(importlib.import_module(module_name), name, None)
    if not callable(target):
        raise ValueError(f"{path!r} is not a callable")
    return target


def shared_bytes_written(engine: Any) -> int:
    """Bytes the engine's shared tiers have written (``CacheStats.shared_bytes_written``)."""
    return engine.cache_stats().shared_bytes_written


class WarmWorker:
    """Warms batches of documents with one engine.

    Args:
        spec: How to build the engine.
        context_documents: The corpus's first documents: warmed (or found stored) before any
            batch, so every worker warms documents behind the same context documents, as one
            process would.
    """

    def __init__(self, spec: EngineSpec, context_documents: list[str] | None = None) -> None:
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        start = time.perf_counter()
        self.engine = spec.build()
        self._context = [text for text in (context_documents or []) if text.strip()]
        self._primed = not self._context
        #: Context documents this worker computed while priming: counted when their batch comes.
        self._computed_early: dict[str, int] = {}
        logger.info("warm worker %s: engine ready in %.1f s", self.name, time.perf_counter() - start)

    def ready(self) -> str:
        """The worker's name, once its engine is built (Ray: wait for the actors with it)."""
        return self.name

    def warm(self, batch: list[SourceDocument]) -> BatchOutcome:
        """Warm ``batch``; a document that raises is reported, the others are still warmed.

        Documents already stored are registered without computing (counted as skipped).
        """
        start = time.perf_counter()
        if not self._primed:
            try:
                for text, result in zip(self._context, self.engine.warm_documents(self._context)):
                    if result.new_tokens:
                        self._computed_early[text] = result.new_tokens
            except Exception as exc:  # noqa: BLE001 - the batch reports its own failures
                logger.warning("warm worker %s: context documents not warmed: %s", self.name, exc)
            self._primed = True
        before = shared_bytes_written(self.engine)
        outcome = BatchOutcome(worker=self.name)
        try:
            results = list(zip(batch, self.engine.warm_documents([doc.text for doc in batch])))
        except Exception:  # noqa: BLE001 - find which documents fail, one at a time
            results = []
            for doc in batch:
                try:
                    results.append((doc, self.engine.warm_documents([doc.text])[0]))
                except Exception as exc:  # noqa: BLE001 - a per-document failure, reported
                    outcome.failures.append(DocumentFailure(doc.doc_id, f"{type(exc).__name__}: {exc}"))
        for doc, result in results:
            outcome.tokens += result.num_tokens
            new_tokens = result.new_tokens or self._computed_early.pop(doc.text, 0)
            if new_tokens:
                outcome.computed += 1
                outcome.computed_tokens += new_tokens
            else:
                outcome.skipped += 1
        outcome.bytes_written = max(0, shared_bytes_written(self.engine) - before)
        outcome.seconds = time.perf_counter() - start
        return outcome
