"""Shared fixtures: a trained tiny tokenizer, tiny random-weight models, the embedded model,
and the device a test runs on (CPU, and CUDA where a test opts in; see :mod:`devices`)."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
from kvboost_rag.log_limits import forget_all
from memory_checks import assert_memory_idle

# One intra-op thread per test process: the suites run one pytest-xdist worker per core, and
# tiny models gain nothing from more (threads spinning against each other slow every pass).
torch.set_num_threads(1)

from devices import DEVICES, engine_device_settings, full_precision_float32
from rag_prompts import SYSTEM_PROMPT

full_precision_float32()  # CUDA's float32 exactness tests compare in full float32 (devices.py)


#: The files that take longest (``--durations`` on 2 cores, seconds of one worker), started first:
#: pytest-xdist hands a worker the next file in collection order as it finishes one, so a long
#: file collected last would run alone at the end while the other worker sits idle.
SLOWEST_FILES = (
    "test_examples.py",  # ~140 s: seven example scripts, each a fresh process
    "test_warm_job.py",  # ~70 s: two Ray jobs
    "test_readme.py",  # ~55 s: the README's and docs' samples on the embedded model
    "test_captured_build.py",  # ~47 s: inductor in two fresh processes
    "test_embedded_model.py",
    "test_captured_prefill.py",
    "test_ray_serve_recipe.py",
    "test_chunked_prefill.py",
    "test_low_precision.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first, the rest in their order (a stable sort: a file's tests keep
    theirs)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))


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


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a test runs on: ``"cpu"``, and ``"cuda"`` (marked ``cuda``: skipped where
    no CUDA device exists, selected by ``pytest -m cuda``). A test opts in by naming this
    fixture (or parametrizing ``device`` itself, :func:`devices.device_params`);
    ``make_engine`` then builds its engines there."""
    return request.param


@pytest.fixture
def make_engine(tokenizer, request: pytest.FixtureRequest):
    """Factory: a fresh engine over a tiny model of the given family, on the test's device
    (the ``device`` fixture or parameter, when the test names it; else the CPU as built).

    After the test, every engine it built must be back to idle (:func:`assert_memory_idle`):
    a place, a counted byte or a lent buffer left behind fails the test that left it."""
    device = request.getfixturevalue("device") if "device" in request.fixturenames else "cpu"
    built: list[KVBoost] = []

    def build(family: str = "llama", **settings) -> KVBoost:
        settings.setdefault("show_progress", False)
        settings.setdefault("chunk_size", 32)
        engine = KVBoost.from_model(tiny_model(family), tokenizer, **engine_device_settings(device), **settings)
        built.append(engine)
        return engine

    yield build
    for engine in built:
        assert_memory_idle(engine)


@pytest.fixture(scope="session")
def embedded_engine():
    """The real embedded SmolLM2-135M-Instruct (converted once per machine)."""
    return KVBoost.from_pretrained(show_progress=False, warm_prefix=SYSTEM_PROMPT + "\n\n")
