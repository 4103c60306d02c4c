"""pytest plugin of the project's test suites: reads of uninitialized memory fail every time.

The engine allocates its K/V buffers with ``torch.empty`` and writes only the rows a prompt
needs. A test (or an engine path) that reads rows nothing wrote would otherwise see whatever
the allocator hands back: zeros on one run, a NaN on the next, so it passes or fails by chance.
This plugin makes every freshly allocated tensor hold a known poison value for the whole
session: torch's deterministic mode with ``fill_uninitialized_memory`` fills floating-point
tensors with NaN and integer tensors with their largest value. A read of an unwritten row then
shows up as a NaN in the output, or a ``torch.equal`` that fails, on every run and every
machine.

Deterministic mode is turned on with ``warn_only=True``: an operation that has no deterministic
implementation (a few CUDA kernels) warns instead of raising, so the suites run the same code
paths the library runs. On CUDA, cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for deterministic
results; the plugin sets it when it is unset, before CUDA starts.

Each suite loads it with ``-p kvboost_rag.dev.pytest_uninitialized`` (``addopts`` in its
``pyproject.toml``); ``KVBOOST_RAG_FILL_UNINITIALIZED=0`` turns it off (to time a test the
way the library runs).
"""

from __future__ import annotations

import os

import pytest

#: The environment variable that turns the poison fill off (``0``).
SWITCH = "KVBOOST_RAG_FILL_UNINITIALIZED"


def enabled() -> bool:
    """Whether the suites poison uninitialized memory (default: yes)."""
    return os.environ.get(SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


def poison_uninitialized_memory() -> None:
    """Fill every tensor torch allocates uninitialized with NaN (floats) or the largest value
    (integers), for the rest of the process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def pytest_configure(config: pytest.Config) -> None:
    if enabled():
        poison_uninitialized_memory()


def pytest_report_header(config: pytest.Config) -> str:
    return f"uninitialized memory: {'filled with NaN' if enabled() else 'not filled'} ({SWITCH})"
