"""The package's modules import each other one way: formatting <- prewarm, retrieval,
rendering <- base; huggingface, structured, tool_calling <- base."""

from __future__ import annotations

import ast
from pathlib import Path

import llama_index.llms.kvboost as package

PACKAGE = "llama_index.llms.kvboost"

#: Modules each module may import from this package (type-checking imports included).
ALLOWED = {
    "formatting": set(),
    "prewarm": {"formatting"},
    "retrieval": {"formatting"},
    "tool_calling": set(),
    "huggingface": set(),
    "structured": set(),
    "rendering": {"formatting"},
    "base": {"formatting", "huggingface", "rendering", "retrieval", "structured", "tool_calling"},
}


def _package_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
    return found


def test_modules_import_one_way() -> None:
    folder = Path(next(iter(package.__path__)))
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert modules == set(ALLOWED), "a new module needs a place in ALLOWED"
    for name in sorted(modules):
        assert _package_imports(folder / f"{name}.py") <= ALLOWED[name], name
