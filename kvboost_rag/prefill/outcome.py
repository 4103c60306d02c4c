"""What prefill hands on: logits, the cache to decode from, and what was reused.

Written by :class:`~kvboost_rag.prefill.prefiller.Prefiller`, read by the engine (decoding, results,
statistics) and by :meth:`~kvboost_rag.cache.manager.CacheManager.write_back`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvboost_rag.hf.caches import ModelCache
from kvboost_rag.request.plan import PlacedDocument


@dataclass
class PrefillOutcome:
    """The result of prefilling one planned prompt.

    Attributes:
        logits: ``[vocab]`` float32 logits of the last prompt token; ``None`` when nothing
            had to be computed (a warm of text already stored).
        cache: The cache to decode from (``None`` with ``logits``).
        keys: ``[layers, kv_heads, >=prompt_tokens, head_dim]`` buffer whose first rows hold
            the prompt's K/V (what write-back cuts stored chunks from).
        values: Same for V.
        prefix_tokens: Leading tokens served by exact prefix hits.
        prefix_keys: Keys of the stored prefix chunks that served them.
        documents: Documents after the prefix hit (their tokens were served from cache,
            computed, or both).
        loaded_chunks: Keys of the document chunks loaded from cache.
        content_tokens: Document tokens whose K/V was loaded and re-rotated.
        recomputed_tokens: Of those, tokens the repair recomputed.
        live_tokens: Tokens computed because nothing was cached for them.
        merged_tokens: Document tokens merged with a neighbour by the tokenizer.
        loaded_kv_bytes: Bytes of K/V copied from loaded entries into the prompt's buffers
            (its prefix rows and its documents' rows).
        strategy: ``"full"``, ``"exact"``, or the repair strategy used.
        recompute_ratio: Share of the loaded document tokens the repair recomputed.
        follow_up: The lookahead repair (``lookahead_ratio``), to run once the first token is
            chosen and before it is decoded: given that token, it recomputes stale cached
            tokens and returns how many.
    """

    logits: torch.Tensor | None
    cache: ModelCache | None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    prefix_tokens: int = 0
    prefix_keys: tuple[str, ...] = ()
    documents: list[PlacedDocument] = field(default_factory=list)
    loaded_chunks: frozenset[str] = frozenset()
    content_tokens: int = 0
    recomputed_tokens: int = 0
    live_tokens: int = 0
    merged_tokens: int = 0
    loaded_kv_bytes: int = 0
    strategy: str = "full"
    recompute_ratio: float = 0.0
    follow_up: Callable[[int], int] | None = None
