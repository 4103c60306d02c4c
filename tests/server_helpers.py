"""Shared pieces of the server tests: the tiny engine and its app (fixtures the test modules
import), SSE parsing, a RAG prompt."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import tiny_engine
from kvboost_rag.server import ServerSettings, create_app

#: The model name the tiny engine's server answers to.
MODEL = "tiny"

#: Settings of the test servers: greedy unless a request says otherwise, short answers.
SETTINGS = ServerSettings(model_names=(MODEL,), temperature=0.0, max_new_tokens=8)

#: A tool with a small schema (a call of it takes 44 tokens of the tiny tokenizer at least).
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the Python reference documentation.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def server_engine() -> KVBoost:
    """A fresh engine over the tiny random-weight llama (chunks of 32 tokens)."""
    return tiny_engine(chunk_size=32, show_progress=False)


@pytest.fixture(scope="module")
def engine() -> KVBoost:
    """One tiny engine per test module."""
    return server_engine()


@pytest.fixture(scope="module")
def client(engine: KVBoost) -> TestClient:
    """The app around :func:`engine`, called in process."""
    return TestClient(create_app(engine, SETTINGS))


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The JSON payloads of a server-sent event stream, checked to end with ``[DONE]``."""
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(item) for item in data[:-1]]


def rag_messages(docs: list[str], question: str = "What does the pass statement do?") -> list[dict[str, Any]]:
    """A system message holding ``docs`` (the frameworks' tutorial layout) and a question."""
    context = "\n\n".join(docs)
    return [
        {"role": "system", "content": f"Use the following pieces of retrieved context to answer.\n\n{context}"},
        {"role": "user", "content": question},
    ]
