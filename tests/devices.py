"""The devices the suite's device-parametrized tests run on.

Every test that matters on a GPU runs twice from one command: on the CPU, and on CUDA where a
CUDA device exists. The CUDA variants carry the ``cuda`` marker: ``kvboost_rag.dev.pytest_ci``
skips them on machines without CUDA (the only skips CI allows, and they cost no time), and
``pytest -m cuda`` selects exactly them. A test opts in by naming the ``device`` fixture of
``conftest.py`` (parametrized over :data:`DEVICES`), or by parametrizing ``device`` together
with another argument (:func:`device_params`); ``make_engine`` then builds its engines there.

On CUDA the float32 exactness tests keep the CPU's tolerance: matrix products run in full
float32 (TF32 off, torch's default, pinned here so an environment cannot turn it on), and the
engine's paths were measured within 1.2e-6 of full prefill on an H200, far inside 1e-4.
The 16-bit tests use the same teacher-forced check as on CPU (:mod:`decoding_checks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch

#: The CUDA parameter: marked ``cuda``, so it is skipped without a CUDA device.
CUDA = pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")

#: The devices a device-parametrized test runs on.
DEVICES = ["cpu", CUDA]


def device_params(cpu: Iterable[Any], cuda: Iterable[Any]) -> list[Any]:
    """``(device, value)`` parameters: each of ``cpu`` on the CPU, each of ``cuda`` on CUDA
    (marked ``cuda``), for a test whose values differ per device (the dtypes it runs in, say).

    Args:
        cpu: Values run on the CPU.
        cuda: Values run on CUDA.
    """
    return [pytest.param("cpu", value, id=f"cpu-{value}") for value in cpu] + [
        pytest.param("cuda", value, marks=pytest.mark.cuda, id=f"cuda-{value}") for value in cuda
    ]


def engine_device_settings(device: str) -> dict[str, str]:
    """Engine settings that put an engine on ``device``: none on the CPU (the model stays
    where it was built, as every CPU test always ran), ``device=...`` elsewhere, with the
    eager decode path (captured steps, on by default on CUDA, compile at load; their own
    tests turn them on)."""
    return {} if device == "cpu" else {"device": device, "captured_steps": "off"}


def full_precision_float32() -> None:
    """Run float32 matrix products on CUDA in full float32 (no TF32) for the rest of the
    process. Sets flags only: touches no GPU and changes nothing on the CPU."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        matmul.fp32_precision = "ieee"
    else:
        matmul.allow_tf32 = False
