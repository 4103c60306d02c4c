"""The LangChain and LlamaIndex adapters reach the engine through one surface.

They import the public names of ``kvboost_rag`` and the framework-free core
``kvboost_rag.integration`` (its package and modules) and nothing else of the engine, so the
engine's stages can move without touching them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = [
    *sorted((ROOT / "integrations" / "langchain-kvboost" / "langchain_kvboost").rglob("*.py")),
    *sorted((ROOT / "integrations" / "llama-index-llms-kvboost" / "llama_index").rglob("*.py")),
]
ALLOWED = ("kvboost_rag", "kvboost_rag.integration")


def _engine_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvboost_rag":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "kvboost_rag"]
    return found


def test_the_adapters_are_found_and_use_the_engine():
    assert len(ADAPTERS) > 15
    assert sum(len(_engine_imports(path)) for path in ADAPTERS) > 20


def test_adapters_import_only_the_public_api_and_the_integration_core():
    outside = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in ADAPTERS
        for line, module in _engine_imports(path)
        if not (module == ALLOWED[0] or module == ALLOWED[1] or module.startswith(ALLOWED[1] + "."))
    ]
    assert outside == [], "adapters reach past kvboost_rag.integration:\n" + "\n".join(outside)
