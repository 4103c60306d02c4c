#!/usr/bin/env bash
# Prepares, on a machine with PyPI, what scripts/gpu_check.sh needs on a GPU machine that has
# Python, torch, numpy, pytest, tokenizers, safetensors and huggingface-hub but no package
# registry, no pydantic and an older transformers (docs/gpu.md):
#   .whl/            wheels of every other package the check imports, --no-deps, for CPython
#                    3.12 on manylinux x86_64, at the versions this checkout's .venv runs
#                    (scripts/setup.sh --test): pydantic and its dependencies, transformers, the
#                    transformers dependency the GPU machine's versions may not meet (regex),
#                    llguidance (constrained decoding);
#   .gpu-tokenizer/  the embedded model's tokenizer files (no weights), which bench/gpu_bench.py
#                    reads there instead of the embedded model.
# Both folders are git-ignored; name both in the device run's carry. Run again after the
# .venv's versions change. GPU_WHEELS_PYTHON (default 3.12) picks another Python version,
# GPU_WHEELS_DIR and GPU_TOKENIZER_DIR other folders (scripts/gpu_check.sh reads the same
# variables).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION="${GPU_WHEELS_PYTHON:-3.12}"
WHEELS="${GPU_WHEELS_DIR:-.whl}"
TOKENIZER="${GPU_TOKENIZER_DIR:-.gpu-tokenizer}"
VENV_PY=.venv/bin/python
if [ ! -x "$VENV_PY" ]; then
  echo "no .venv: run scripts/setup.sh --test first (the wheels take the versions it installed)" >&2
  exit 1
fi

# What the GPU machine lacks, or has at a version below what this project (or transformers)
# needs. transformers' other requirements are met there: huggingface-hub 1.33, tokenizers
# 0.23.2, safetensors 0.8.0, numpy, packaging, pyyaml, tqdm, typer.
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions transformers regex llguidance)
mapfile -t PINNED < <("$VENV_PY" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import version

for name in sys.argv[1:]:
    print(f"{name}=={version(name)}")
EOF
)

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
PLATFORMS=()
# The GPU machine runs glibc 2.39 (Ubuntu 24.04, Python 3.12.3): manylinux up to 2_35 is safe there.
for tag in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
"$VENV_PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYTHON_VERSION" --implementation cp "${PLATFORMS[@]}" -d "$WHEELS" "${PINNED[@]}"

# transformers' requirements, to compare with what the GPU machine has (docs/gpu.md).
echo "transformers requires:"
unzip -p "$WHEELS"/transformers-*.whl '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^/  /'

# The embedded model's tokenizer (its weights stay here).
SOURCE="$("$VENV_PY" -c 'from kvboost_rag.default_model import default_model_dir; print(default_model_dir())')"
rm -rf "$TOKENIZER"
mkdir -p "$TOKENIZER"
for name in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
  if [ -f "$SOURCE/$name" ]; then
    cp "$SOURCE/$name" "$TOKENIZER/"
  fi
done
test -f "$TOKENIZER/tokenizer.json"

echo "wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1)):"
ls "$WHEELS" | sed 's/^/  /'
echo "tokenizer in $TOKENIZER: $(ls "$TOKENIZER" | tr '\n' ' ')"
