"""pytest plugin of the project's test suites: tests that leave nothing behind for the next one.

Engines built with default settings spill what memory evicts to an automatic disk tier. The
suites keep it out of the user's cache folder: a folder for the session's shared engines
(removed at exit) and a fresh one per test (autouse), so no run sees what an earlier one left.

Each suite loads it with ``-p kvboost_rag.dev.pytest_isolation`` (``addopts`` in its
``pyproject.toml``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

#: The environment variable naming the automatic disk tier's folder.
KV_CACHE_VARIABLE = "KVBOOST_RAG_KV_CACHE"

# Set when the plugin loads, before any test module builds a shared engine.
_SESSION_KV_CACHE = tempfile.mkdtemp(prefix="kvboost-test-kv-")
os.environ[KV_CACHE_VARIABLE] = _SESSION_KV_CACHE
atexit.register(shutil.rmtree, _SESSION_KV_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_kv_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's engines spill to a folder of their own."""
    monkeypatch.setenv(KV_CACHE_VARIABLE, str(tmp_path_factory.mktemp("kv-cache")))
