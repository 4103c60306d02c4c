"""What a model supports, probed once when the engine is built.

Each probe runs the model on one or two tokens and checks that the path the engine relies on
was taken. A probe that fails does not fail quietly later: the engine either refuses the model
(:class:`~kvboost_rag.errors.UnsupportedModelError`, for the K/V layout) or takes one named
fallback that every result then reports (:class:`ModelFeatures`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from kvboost_rag.cache.codec import KVLayout
from kvboost_rag.errors import UnsupportedModelError
from kvboost_rag.hf.caches import ModelCache, cache_keyword
from kvboost_rag.hf.packed import Segment, SegmentOutput, attention_calls
from kvboost_rag.attention_backends.sparse import last_query_attention


class ProbedModel(Protocol):
    """What the feature probes run (the model adapter has it; the probes do not import it)."""

    tokenizer: Any
    num_layers: int

    def new_cache(self, capacity: int) -> ModelCache: ...

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: ModelCache, sparse_queries: bool = False
    ) -> torch.Tensor: ...

    def forward_packed(self, segments: Sequence[Segment]) -> list[SegmentOutput]: ...


@dataclass(frozen=True)
class ModelFeatures:
    """What the engine found the model supports.

    Attributes:
        batched_decoding: One forward pass runs several sequences' tokens, each over its own
            K/V (the engine loop's packed pass: decode rows and slices of prompt work
            together); else one pass per sequence and per slice: the fallback.
        batched_decoding_reason: Why not, when it does not.
        records_attention: The model's attention goes through transformers' attention
            interface, so the attention repair can read what the last token attends to (else
            the engine repairs with CacheBlend and results say ``strategy="cacheblend"``).
    """

    batched_decoding: bool
    batched_decoding_reason: str
    records_attention: bool


def _probe_token(tokenizer) -> int:
    return tokenizer.pad_token_id or tokenizer.eos_token_id or 0


@torch.inference_mode()
def probe_layout(model: torch.nn.Module, tokenizer, device: torch.device) -> KVLayout:
    """The K/V layout of the model's cache, from one token run through it.

    Raises:
        UnsupportedModelError: Layers with different K/V shapes.
    """
    cache = DynamicCache()
    token = torch.tensor([[_probe_token(tokenizer)]], device=device)
    model(input_ids=token, use_cache=True, **{cache_keyword(model): cache})
    shapes = {tuple(layer.keys.shape) for layer in cache.layers}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"layers with different K/V shapes are not supported: {sorted(shapes)}")
    _, heads, _, dim = shapes.pop()
    return KVLayout(layers=len(cache.layers), kv_heads=heads, head_dim=dim)


def probe_features(adapter: ProbedModel) -> ModelFeatures:
    """Probe batched decoding and attention recording on one or two tokens."""
    token = torch.tensor([_probe_token(adapter.tokenizer)])
    cache = adapter.new_cache(3)
    adapter.forward(token, torch.tensor([0]), cache)
    before = attention_calls()
    adapter.forward_packed([Segment(token, torch.tensor([1]), cache, logits=1)])
    calls = attention_calls() - before
    batched = calls == adapter.num_layers
    reason = "" if batched else (
        f"this model's attention does not go through transformers' attention interface ({calls} of "
        f"{adapter.num_layers} layers)"
    )
    with last_query_attention() as recorded:
        adapter.forward(token, torch.tensor([2]), cache, sparse_queries=True)
    return ModelFeatures(
        batched_decoding=batched, batched_decoding_reason=reason, records_attention=len(recorded) == adapter.num_layers
    )
