"""The parts of one engine that warming and the request lifecycle both work with."""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_rag.cache_manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.plan import Planner
from kvboost_rag.prefill import Prefiller
from kvboost_rag.scheduler import ModelTurns
from kvboost_rag.text import Tokenizing


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
        turns: The model lock (prefills, warms and decode steps take turns).
    """

    adapter: ModelAdapter
    cache: CacheManager
    settings: KVBoostSettings
    tokenizing: Tokenizing
    planner: Planner
    prefiller: Prefiller
    turns: ModelTurns
