"""kvboost-rag: faster RAG answers on local HuggingFace causal LMs by reusing K/V.

The system prompt and other shared beginnings hit by a prefix-chained hash and are reused
exactly; retrieved documents hit by a content hash wherever they land in the prompt, their
keys are re-rotated to the new positions and the cross-document attention they missed is
repaired by recomputing the few of their tokens the prompt's last token attends to most.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvboost_rag import _aliases
from kvboost_rag.errors import (
    InvalidInputError,
    KVBoostError,
    ModelNotFoundError,
    PromptTooLongError,
    RequestCancelled,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from kvboost_rag.config import KVBoostSettings
    from kvboost_rag.engine import GenerationStream, KVBoost
    from kvboost_rag.results import CacheStats, CorrectnessReport, GenerationResult, PromptCheck, WarmResult

#: Names imported on first use, so that ``import kvboost_rag.default_model`` (what
#: scripts/setup.sh runs to find the converted model) does not import torch and transformers.
_LAZY = {
    "KVBoostSettings": "kvboost_rag.config",
    "GenerationStream": "kvboost_rag.engine",
    "KVBoost": "kvboost_rag.engine",
    **dict.fromkeys(["CacheStats", "CorrectnessReport", "GenerationResult", "PromptCheck", "WarmResult"], "kvboost_rag.results"),
}

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
    "RequestCancelled",
    "UnsupportedModelError",
    "WarmResult",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_aliases.install()
