"""Decode on a model quantized through torchao: its own layers against its stored int8 values
read by the engine's int8 kernel, beside the float32 model and transformers ``generate``.

The model is loaded twice and quantized with torchao's ``Int8WeightOnlyConfig`` (what
transformers' ``TorchAoConfig`` does at load): one engine decodes through the layers' own
``forward`` (``decode_weights="model"``: torchao widens the int8 values to float32 every call),
the other reads the stored values and scales (``decode_weights="int8"``,
``kvboost_rag/decode_weights/stored_int8.py``). Rows per prompt, interleaved, no drafts, greedy: the float32
model's engine (its default settings), the two engines over the quantized model, and
``generate`` on the quantized model. Reports decode ms per token and how many leading tokens
the int8 answer shares with the layers' own.

Run: ``python -u bench/stored_int8_bench.py --threads 2 [--model DIR] [--prompts 3]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_bench import Run, build_prompts, leading_equal, run_engine, run_generate  # noqa: E402
from kvboost_rag import KVBoost  # noqa: E402
from kvboost_rag.default_model import default_model_dir  # noqa: E402

logger = logging.getLogger("stored_int8_bench")
ROWS = ("float32 engine", "torchao, own forward", "torchao, stored int8", "torchao generate")


def quantized_engine(path: str, decode_weights: str) -> KVBoost:
    """An engine over the model at ``path`` quantized by torchao's int8 weight-only config."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))
    return KVBoost.from_model(model, AutoTokenizer.from_pretrained(path), decode_weights=decode_weights, show_progress=False)


def prompt_rows(engines: list[KVBoost], prompt: str, new_tokens: int) -> list[Run]:
    """One prompt's answers in :data:`ROWS`' order."""
    runs = [run_engine(engine, prompt, new_tokens, 0) for engine in engines]
    quantized = engines[1]
    runs.append(run_generate(quantized.model, quantized.tokenizer, prompt, len(runs[1].tokens)))
    return runs


def report(results: list[tuple[str, list[Run]]], header: str) -> list[str]:
    """The report's lines: per prompt, decode ms per token of each row and the ratios."""
    lines = [header, "", "| # | kind | new tok | " + " | ".join(f"{row} ms/tok" for row in ROWS) + " | own / stored int8 | generate / stored int8 | float32 / stored int8 | leading tokens equal (stored int8 vs own) |"]
    lines.append("|" + "---:|" * 3 + "---:|" * len(ROWS) + "---:|---:|---:|---|")
    ratios: list[tuple[float, float, float]] = []
    for i, (kind, runs) in enumerate(results):
        ms = [1000 / run.decode_rate for run in runs]  # decode ms per token after the first
        ratio = (ms[1] / ms[2], ms[3] / ms[2], ms[0] / ms[2])
        ratios.append(ratio)
        cells = " | ".join(f"{m:.1f}" for m in ms)
        equal = leading_equal(runs[2].tokens, runs[1].tokens)
        lines.append(f"| {i} | {kind} | {len(runs[1].tokens)} | {cells} | {ratio[0]:.2f}x | {ratio[1]:.2f}x | {ratio[2]:.2f}x | {equal} of {len(runs[1].tokens)} |")
    medians = [statistics.median(r[k] for r in ratios) for k in range(3)]
    lines += ["", f"Medians: stored int8 decodes {medians[0]:.2f}x as fast as the layers' own forward, {medians[1]:.2f}x `generate` on the quantized model, {medians[2]:.2f}x the float32 model's engine."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    path = args.model or str(default_model_dir())
    engines = [KVBoost.from_pretrained(path, show_progress=False), quantized_engine(path, "model"), quantized_engine(path, "int8")]
    prompts, docs, beginning = build_prompts(engines[0].tokenizer, args.prompts, 6, 1600, False, args.seed)
    for engine in engines:
        engine.warm_documents(docs, show_progress=False)
        engine.warm(beginning)
    results = [(kind, prompt_rows(engines, prompt, args.new_tokens)) for kind, prompt in prompts]
    header = (
        f"stored_int8_bench: {Path(path).name}, {args.prompts} chat prompts of 6 documents, {args.new_tokens} new tokens, greedy, "
        f"no drafts, {args.threads} torch threads, torch {torch.__version__}; kernels: float32 engine "
        f"{engines[0].small_row_kernel}, stored int8 engine {engines[2].small_row_kernel}"
    )
    lines = report(results, header)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
