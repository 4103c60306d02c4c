"""kvboost-rag: faster RAG answers on local HuggingFace causal LMs by reusing K/V.

The system prompt and other shared beginnings hit by a prefix-chained hash and are reused
exactly; retrieved documents hit by a content hash wherever they land in the prompt, their
keys are re-rotated to the new positions and the cross-document attention they missed is
repaired by recomputing the few of their tokens the prompt's last token attends to most.
"""

from kvboost_rag import _aliases
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.engine import GenerationStream, KVBoost
from kvboost_rag.errors import (
    InvalidInputError,
    KVBoostError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from kvboost_rag.results import (
    CacheStats,
    CorrectnessReport,
    GenerationResult,
    PromptCheck,
    WarmResult,
)

__all__ = [
    "CacheStats",
    "CorrectnessReport",
    "GenerationResult",
    "GenerationStream",
    "InvalidInputError",
    "KVBoost",
    "KVBoostError",
    "KVBoostSettings",
    "ModelNotFoundError",
    "PromptCheck",
    "PromptTooLongError",
    "UnsupportedModelError",
    "WarmResult",
]

__version__ = "0.1.0"

_aliases.install()
