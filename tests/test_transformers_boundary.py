"""Only ``kvboost_rag/hf`` touches transformers internals.

Every other module of the engine and of both integrations uses transformers' public API
(loading models and tokenizers, configs, one logits processor) and the boundary package.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUNDARY = ROOT / "kvboost_rag" / "hf"
SOURCES = [
    *sorted((ROOT / "kvboost_rag").rglob("*.py")),
    *sorted((ROOT / "integrations" / "langchain-kvboost" / "langchain_kvboost").rglob("*.py")),
    *sorted((ROOT / "integrations" / "llama-index-llms-kvboost" / "llama_index").rglob("*.py")),
]
#: Names of transformers internals (private attributes, cache and attention machinery).
INTERNALS = (
    "_attn_implementation",
    "_name_or_path",
    "layer_class_to_replicate",
    "ddp_cache_data",
    "DynamicCache",
    "DynamicLayer",
    "AttentionInterface",
    "AttentionMaskInterface",
    "rotary_emb",
    "inv_freq",
    "base_model_prefix",
    "register_forward_hook",
    "register_forward_pre_hook",
)
#: What modules outside the boundary may import from transformers' top level.
PUBLIC_IMPORTS = {
    "AutoConfig",
    "AutoModelForCausalLM",
    "AutoTokenizer",
    "PretrainedConfig",
    "PreTrainedTokenizerFast",
    "RepetitionPenaltyLogitsProcessor",
}
_IMPORT = re.compile(r"^\s*from transformers(\.[\w.]+)? import (\([^)]*\)|[^\n]*)", re.MULTILINE)


def _outside_boundary() -> list[Path]:
    return [path for path in SOURCES if BOUNDARY not in path.parents]


def test_the_sources_are_found():
    assert len(_outside_boundary()) > 40 and (BOUNDARY / "adapter.py").exists()


def test_no_module_outside_the_boundary_names_transformers_internals():
    found = []
    for path in _outside_boundary():
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        for name in INTERNALS:
            if re.search(rf"\b{name}\b", code.replace("transformers' AttentionInterface", "")):
                found.append(f"{path.relative_to(ROOT)}: {name}")
    assert found == []


def test_no_module_outside_the_boundary_imports_transformers_internals():
    found = []
    for path in _outside_boundary():
        for match in _IMPORT.finditer(path.read_text()):
            submodule, names = match.groups()
            names = names.strip("()").replace("\n", ",")
            imported = {name.strip().split(" as ")[0] for name in names.split(",") if name.strip()}
            if submodule or not imported <= PUBLIC_IMPORTS:
                found.append(f"{path.relative_to(ROOT)}: from transformers{submodule or ''} import {sorted(imported)}")
    assert found == []


def test_the_check_catches_an_internal(tmp_path):
    code = "config._attn_implementation = 'x'\nfrom transformers.cache_utils import DynamicLayer\n"
    assert any(re.search(rf"\b{name}\b", code) for name in INTERNALS)
    assert _IMPORT.search(code).group(1) == ".cache_utils"
