"""Fixtures shared by the unit and integration tests of langchain-kvboost."""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import re
import shutil
import tempfile

import pytest
from langchain_core.embeddings import Embeddings

# Engines built with default settings spill what memory evicts to an automatic disk tier: the
# tests keep it out of the user's cache folder (a folder for the session's shared engines,
# removed at exit, and a fresh one per test), so no run sees what an earlier one left.
_SESSION_KV_CACHE = tempfile.mkdtemp(prefix="kvboost-test-kv-")
os.environ["KVBOOST_RAG_KV_CACHE"] = _SESSION_KV_CACHE
atexit.register(shutil.rmtree, _SESSION_KV_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_kv_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's engines spill to a folder of their own."""
    monkeypatch.setenv("KVBOOST_RAG_KV_CACHE", str(tmp_path_factory.mktemp("kv-cache")))


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
