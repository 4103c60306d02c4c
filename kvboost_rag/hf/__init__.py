"""The engine's boundary to transformers: the only package that touches its internals.

Cache classes (:mod:`~kvboost_rag.hf.caches`), the attention switch and the registration of
the engine's attention functions (:mod:`~kvboost_rag.hf.attention_switch`), running a range of
decoder layers (:mod:`~kvboost_rag.hf.layers`), RoPE discovery (:mod:`~kvboost_rag.hf.rope`),
attention windows (:mod:`~kvboost_rag.hf.windows`), feature probes
(:mod:`~kvboost_rag.hf.probes`), the adapter the engine calls
(:mod:`~kvboost_rag.hf.adapter`), the packed pass of several sequences' tokens over their own
K/V (:mod:`~kvboost_rag.hf.packed`), passes as requests of prompt work
(:mod:`~kvboost_rag.hf.passes`), captured steps: compiled graphs over a static K/V pool
(:mod:`~kvboost_rag.hf.captured`).
"""

from kvboost_rag.hf.adapter import ModelAdapter
from kvboost_rag.hf.caches import BufferedCache, ModelCache
from kvboost_rag.hf.probes import ModelFeatures

__all__ = ["BufferedCache", "ModelAdapter", "ModelCache", "ModelFeatures"]
