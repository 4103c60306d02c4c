"""Fixtures shared by the unit and integration tests of langchain-kvboost."""

from __future__ import annotations

import hashlib
import math
import re

import pytest
import torch
from langchain_core.embeddings import Embeddings

# One intra-op thread per test process: the suite runs one pytest-xdist worker per core, and
# the engine's decode worker runs beside the calling thread; more threads than cores make each
# forward pass up to ~10x slower (threads spinning against each other).
torch.set_num_threads(1)

# Each test's engines spill to a folder of their own (kvboost_rag.dev.pytest_isolation, loaded in addopts).


_WORD = re.compile(r"[a-z_][a-z0-9_]+")


class BagOfWordsEmbeddings(Embeddings):
    """Deterministic lexical embedding: word counts hashed into buckets, L2-normalised.

    Unlike a random hash-per-text embedding, queries retrieve documents that share their
    words, so tests can pick questions whose results overlap.
    """

    def __init__(self, size: int = 512) -> None:
        self.size = size

    def _embed(self, text: str) -> list[float]:
        vector = [0.0] * self.size
        for word in _WORD.findall(text.lower()):
            bucket = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big")
            vector[bucket % self.size] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self._embed(text) for text in texts]

    def embed_query(self, text: str) -> list[float]:
        return self._embed(text)


@pytest.fixture(scope="session")
def embeddings() -> BagOfWordsEmbeddings:
    return BagOfWordsEmbeddings()
