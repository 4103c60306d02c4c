"""Shared fixtures: tiny real engines, a deterministic embedding, an LLM call recorder."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMCompletionEndEvent,
)

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

# One intra-op thread per test process: the suite runs one pytest-xdist worker per core, and
# the engine's decode worker runs beside the calling thread; more threads than cores make each
# forward pass up to ~10x slower (threads spinning against each other).
torch.set_num_threads(1)

# Each test's engines spill to a folder of their own (kvboost_rag.dev.pytest_isolation, loaded in addopts).


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: uses the real embedded model (SmolLM2-135M-Instruct); still run in CI")


class HashEmbedding(BaseEmbedding):
    """Deterministic bag-of-words embedding: signed feature hashing of lower-cased words.

    Texts sharing words get similar vectors, so retrieval is meaningful and reproducible
    across processes (blake2b, not Python's salted ``hash``).
    """

    dim: int = Field(default=256, gt=0, description="Vector size.")

    def __init__(self, dim: int = 256, **kwargs: Any) -> None:
        super().__init__(model_name="hash-bow", dim=dim, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "HashEmbedding"

    def _vector(self, text: str) -> list[float]:
        vec = [0.0] * self.dim
        for word in re.findall(r"[a-z_][a-z0-9_]+", text.lower()):
            digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
            vec[digest % self.dim] += 1.0 if (digest >> 40) & 1 else -1.0
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        return [v / norm for v in vec]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)


class LLMCallRecorder(BaseEventHandler):
    """Collects the ``raw`` of every finished LLM call (chat or completion) and its prompt."""

    calls: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "LLMCallRecorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.calls.append({"kind": "chat", "messages": list(event.messages), "raw": dict(event.response.raw or {})})
        elif isinstance(event, LLMCompletionEndEvent):
            self.calls.append({"kind": "completion", "prompt": event.prompt, "raw": dict(event.response.raw or {})})

    def reset(self) -> None:
        self.calls.clear()


@pytest.fixture(scope="session")
def tiny_parts() -> tuple[Any, Any]:
    """A tiny random-weight Llama and its tokenizer (built once per session)."""
    return tiny_model("llama"), tiny_tokenizer()


@pytest.fixture
def tiny_engine(tiny_parts: tuple[Any, Any]) -> KVBoost:
    """A fresh engine (empty cache) on the shared tiny model."""
    model, tokenizer = tiny_parts
    return KVBoost.from_model(model, tokenizer, show_progress=False)


@pytest.fixture
def recorder() -> Iterator[LLMCallRecorder]:
    """An LLM call recorder attached to the root instrumentation dispatcher."""
    handler = LLMCallRecorder()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    try:
        yield handler
    finally:
        dispatcher.event_handlers = [h for h in dispatcher.event_handlers if h is not handler]


@pytest.fixture(scope="session")
def hash_embedding() -> HashEmbedding:
    """The deterministic embedding (stateless, shared)."""
    return HashEmbedding()
