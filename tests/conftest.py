"""Shared fixtures: a trained tiny tokenizer, tiny random-weight models, the embedded model."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.log_limits import forget_all
from kvboost_rag.testing import tiny_model, tiny_tokenizer

# One thread: predictable on a shared 2-core machine, and tiny models gain nothing from more.
torch.set_num_threads(1)

from rag_prompts import SYSTEM_PROMPT


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


@pytest.fixture(autouse=True)
def _fresh_warning_limits() -> None:
    """Rate-limited warnings start afresh in each test: one test's warnings never silence the
    warning another test checks for (module-level limiters outlive a test module)."""
    forget_all()


@pytest.fixture(scope="session")
def tokenizer():
    """Byte-level BPE tokenizer trained on the Python reference docs."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def docs() -> list[str]:
    """Six real reference documents of a few hundred characters."""
    return python_reference_documents(max_chars=320)[:6]


@pytest.fixture
def make_engine(tokenizer):
    """Factory: a fresh engine over a tiny model of the given family."""

    def build(family: str = "llama", **settings) -> KVBoost:
        settings.setdefault("show_progress", False)
        settings.setdefault("chunk_size", 32)
        return KVBoost.from_model(tiny_model(family), tokenizer, **settings)

    return build


@pytest.fixture(scope="session")
def embedded_engine():
    """The real embedded SmolLM2-135M-Instruct (converted once per machine)."""
    return KVBoost.from_pretrained(show_progress=False, warm_prefix=SYSTEM_PROMPT + "\n\n")
