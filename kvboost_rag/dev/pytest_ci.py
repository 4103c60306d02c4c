"""pytest plugin of the project's test suites: CUDA-only tests, and no silent skips in CI.

A test that skips because a real component is missing (the ``redis-server`` binary, an
optional extra, the embedded model) proves nothing, and in CI that must be seen, not counted
as a pass. So under ``CI=true`` every skip raised by the project's own tests and fixtures is a
failure, except two kinds:

- tests marked ``cuda``: they need a GPU, which CI machines do not have, and are skipped
  wherever none is found (the same command runs them on a GPU machine);
- skips raised inside an installed package (``site-packages``): the standard suites of
  ``langchain-tests`` skip the checks of features a model does not declare (image inputs, a
  per-call model override), which is their design, not a missing component.

Outside CI a skip stays a skip, with its reason.

Each suite loads it with ``-p kvboost_rag.dev.pytest_ci`` (``addopts`` in its ``pyproject.toml``).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

#: Marker of tests that need a CUDA device; the only tests CI may skip.
CUDA_MARK = "cuda"


def in_ci() -> bool:
    """Whether the run is CI's (``CI=true``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{CUDA_MARK}: needs a CUDA device; the only tests CI may skip")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker(CUDA_MARK) is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


def _raised_in_installed_package(report: pytest.TestReport) -> bool:
    """Whether the skip came from code in ``site-packages`` (a standard suite's own check)."""
    location = report.longrepr[0] if isinstance(report.longrepr, tuple) else ""
    return "site-packages" in Path(str(location)).parts


def _fail(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true (a skip proves nothing in CI): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker(CUDA_MARK) is None and not _raised_in_installed_package(report):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and in_ci():  # a module skipped whole (pytest.importorskip at import)
        _fail(report)
