"""Shared fixtures: a trained tiny tokenizer, tiny random-weight models, the embedded model."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
from kvboost_rag.log_limits import forget_all

# One intra-op thread per test process: the suites run one pytest-xdist worker per core, and
# tiny models gain nothing from more (threads spinning against each other slow every pass).
torch.set_num_threads(1)

from rag_prompts import SYSTEM_PROMPT

# Each test's engines spill to a folder of their own (kvboost_rag.dev.pytest_isolation, loaded in addopts).


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
