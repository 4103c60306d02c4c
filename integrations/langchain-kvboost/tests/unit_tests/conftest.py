"""Unit-test fixtures: a fresh tiny random-weight engine per test (about 0.1 s to build)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

#: Small chunks so that the short texts of unit tests span several cached chunks.
TINY_ENGINE_SETTINGS: dict[str, Any] = {"chunk_size": 16, "show_progress": False}


def build_tiny_engine(**settings: Any) -> Any:
    """A kvboost engine over a tiny llama-architecture model and the tiny BPE tokenizer."""
    from kvboost_rag import KVBoost
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

    return KVBoost.from_model(tiny_model("llama"), tiny_tokenizer(), **{**TINY_ENGINE_SETTINGS, **settings})


@pytest.fixture
def engine() -> Any:
    return build_tiny_engine()


@pytest.fixture
def make_engine() -> Callable[..., Any]:
    """Builds more tiny engines (settings as keyword arguments)."""
    return build_tiny_engine
