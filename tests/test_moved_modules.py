"""Module paths of earlier releases keep importing, as the very modules at their new paths."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kvboost_rag._aliases import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_path(old):
    moved = importlib.import_module(f"kvboost_rag.{old}")
    assert moved is importlib.import_module(f"kvboost_rag.{MOVED[old]}")
    assert moved.__spec__.name == f"kvboost_rag.{MOVED[old]}"  # the module's own spec is kept


def test_old_paths_warn_once_naming_the_new_path():
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from kvboost_rag.attention import use_backend\n"
        "    import kvboost_rag.attention\n"
        "    from kvboost_rag.storage import TieredStore\n"
        "print([str(w.message) for w in caught if w.category is DeprecationWarning])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(
        [
            "kvboost_rag.attention moved to kvboost_rag.attention_backends.sparse; import it from there",
            "kvboost_rag.storage moved to kvboost_rag.cache.storage; import it from there",
        ]
    )


def test_every_old_path_is_gone_from_the_tree():
    """An alias never hides a module: no file or folder sits at an old path."""
    from pathlib import Path

    import kvboost_rag

    root = Path(kvboost_rag.__file__).parent
    for old in MOVED:
        path = root.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists() and not (path / "__init__.py").exists(), old
