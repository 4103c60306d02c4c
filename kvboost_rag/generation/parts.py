"""The parts of one engine that warming and the request lifecycle both work with."""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_rag.cache.manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.engine_loop import EngineLoop
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.prefill.prefiller import Prefiller
from kvboost_rag.request.documents import DocumentRecord
from kvboost_rag.request.plan import Planner
from kvboost_rag.request.text import Tokenizing


@dataclass(frozen=True)
class EngineParts:
    """What a prompt or a warm goes through, built once by the engine facade.

    Attributes:
        adapter: The model adapter.
        cache: The cache manager.
        settings: Engine settings.
        tokenizing: Text to tokens.
        planner: Plans prompts.
        prefiller: Lookup, stitching, repair.
        loop: The engine loop: runs every pass of prompt work and every decode step.
    """

    adapter: ModelAdapter
    cache: CacheManager
    settings: KVBoostSettings
    tokenizing: Tokenizing
    planner: Planner
    prefiller: Prefiller
    loop: EngineLoop

    def document_record(self, text: str, register: bool = True) -> DocumentRecord:
        """The stored record of ``text`` (read from the tiers, not re-tokenized), else a new
        one, tokenized, and (with ``register``) stored and registered; a warm registers it
        once its chunks are stored, as the newest entry of its document."""
        record = self.cache.index.find_document(text)
        if record is None:
            record = self.tokenizing.record(text, self.cache.fingerprint, self.settings.chunk_size)
            record.ngrams  # noqa: B018 - indexed once, when the document is read: decoding drafts from it
            if register:
                self.cache.index.register(record)
        return record
