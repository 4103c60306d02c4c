"""The engine's internals that benchmarks read: one documented surface.

Some benchmarks measure what no public call shows: the tier stack under a fault, the bytes of
the decode-weight copies, one stage of the prefill timed alone, a constraint's guide. They reach
the engine's parts through :func:`internals` only, so a change inside the engine changes this
module, not every bench. Not a public API: the names follow the engine's layout and change
with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvboost_rag.cache.manager import CacheManager
    from kvboost_rag.cache.storage import StorageTier, TieredStore
    from kvboost_rag.engine import KVBoost
    from kvboost_rag.engine_loop import EngineLoop
    from kvboost_rag.generation.host_buffers import HostBufferPool
    from kvboost_rag.hf import ModelAdapter
    from kvboost_rag.request.plan import Planner
    from kvboost_rag.request.text import Tokenizing


@dataclass(frozen=True)
class EngineInternals:
    """An engine's parts, as built at load.

    Attributes:
        cache: The cache manager (index, write-back, host copies).
        adapter: The model boundary (its ``small_rows`` holds the decode-weight copies).
        tokenizing: The prompt tokenizer (finds documents, builds records).
        planner: Plans a prompt's reuse from its tokens.
        constraints: Compiles constrained-decoding formats into guides.
        host_buffers: The pool of lent host K/V buffers (``None`` on a device).
        captured: The captured decode steps (``None`` when off).
        captured_prefill: The captured prompt passes (``None`` when off).
        captured_probe: The captured probe passes (``None`` when off).
        loop: The engine loop (``active``: whether its thread runs; it ends once idle).
    """

    cache: CacheManager
    adapter: ModelAdapter
    tokenizing: Tokenizing
    planner: Planner
    constraints: Any
    host_buffers: HostBufferPool | None
    captured: Any
    captured_prefill: Any
    captured_probe: Any
    loop: EngineLoop

    @property
    def store(self) -> TieredStore:
        """The tier stack the cache writes to."""
        return self.cache._store

    @property
    def tiers(self) -> list[StorageTier]:
        """The tiers, fastest first."""
        return list(self.store.tiers)


def internals(engine: KVBoost) -> EngineInternals:
    """``engine``'s parts, for a benchmark that measures one of them."""
    return EngineInternals(
        cache=engine._cache,
        adapter=engine._adapter,
        tokenizing=engine._tokenizing,
        planner=engine._requests.planner,
        constraints=engine._constraints,
        host_buffers=engine._requests.memory.host_buffers,
        captured=engine._captured,
        captured_prefill=engine._captured_prefill,
        captured_probe=engine._captured_probe,
        loop=engine._loop,
    )
