"""The linear layers of one decode or verify step on each kernel: ms for a pass over a model's layers.

A decode step's linear layers read every weight once whatever its few rows, so on a CPU its cost
is the bytes read. This times one pass over linear layers of a model's shapes (its config's
projections, MLPs and output layer; random weights, as the kernels do not care what the values
are), at 1, 4, 8, 16 and 64 rows, on each kernel:

- ``F.linear``: float32, the model's own weights (MKL ``sgemm``);
- ``packed``: oneDNN's inner product over the float32 weights reordered once into its blocked
  layout (:mod:`kvboost_rag.decode_weights.small_rows`);
- ``int8 dynamic``: FBGEMM's dynamic quantized linear over int8 weights with one float32 scale
  per output channel, each row's activations rounded to 8 bits, as decode runs it
  (:class:`kvboost_rag.decode_weights.int8_rows.DynamicInt8Linear`), a quarter of the bytes;
- ``int8 fused``: the engine's int8 kernel (the dynamic one where available) with each layer's
  query, key and value projections as one product and its gate and up projections as another,
  as the engine multiplies them (:func:`kvboost_rag.decode_weights.int8_siblings.fused_copy`): 4 calls a
  decoder layer instead of 7;
- ``int8 weight-only``: ``torch.ops.aten._weight_int8pack_mm`` over the same int8 weights
  (:class:`kvboost_rag.decode_weights.int8_rows.WeightOnlyInt8Linear`: activations rounded to bfloat16, the
  kernel's vectorized path), the fallback where a torch build has no FBGEMM.

Rounds are interleaved and the median of ``--reps`` is kept. Run:
``python -u bench/int8_kernels.py --threads 1 2`` (``--model PATH`` for another model folder,
several allowed; default the embedded model and the Qwen 0.5B folder when present).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvboost_rag.decode_weights.int8_rows import DynamicInt8Linear, WeightOnlyInt8Linear, quantize_rows  # noqa: E402
from kvboost_rag.decode_weights.int8_siblings import fused_copy  # noqa: E402
from kvboost_rag.decode_weights.small_rows import PACKED_FOR_ROWS  # noqa: E402

ROWS = (1, 4, 8, 16, 64)


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of a decoder's linear layers, output layer last."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    block = [
        (heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
        (hidden, heads * head_dim), (inner, hidden), (inner, hidden), (hidden, inner),
    ]
    return block * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def fused_groups(count: int, layers_per_block: int = 7) -> list[list[int]]:
    """Indexes of :func:`layer_shapes`' layers as the engine multiplies them on int8: query,
    key and value as one product, gate and up as one (``kvboost_rag.decode_weights.int8_siblings``)."""
    groups = []
    for start in range(0, count - 1, layers_per_block):
        q, k, v, o, gate, up, down = range(start, start + layers_per_block)
        groups += [[q, k, v], [o], [gate, up], [down]]
    return groups + [[count - 1]]


@torch.inference_mode()
def time_model(name: str, config: dict, threads: int, reps: int) -> list[str]:
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) * 0.02 for shape in layer_shapes(config)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACKED_FOR_ROWS) for w in weights]
    quantized = [quantize_rows(w) for w in weights]
    dynamic = [DynamicInt8Linear(q, scales, None) for q, scales in quantized]
    weight_only = [WeightOnlyInt8Linear(q, scales, None) for q, scales in quantized]
    groups = fused_groups(len(weights))
    fused = [fused_copy([quantized[i] for i in group], [None] * len(group)) for group in groups]
    each = [[i] for i in range(len(weights))]
    kernels = {  # name: (product of call i, the layers call i multiplies: its input is the first's)
        "F.linear": (lambda x, i: F.linear(x, weights[i]), each),
        "packed": (lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], ""), each),
        "int8 dynamic": (lambda x, i: dynamic[i](x), each),
        "int8 fused": (lambda x, i: fused[i](x), groups),
        "int8 weight-only": (lambda x, i: weight_only[i](x), each),
    }
    inputs = {rows: [torch.randn(rows, w.shape[1], generator=generator) for w in weights] for rows in ROWS}
    seconds: dict[tuple[str, int], list[float]] = {}
    for rep in range(reps + 1):  # the first round warms up
        for kernel, (call, calls) in kernels.items():
            for rows in ROWS:
                start = time.perf_counter()
                for i, group in enumerate(calls):
                    call(inputs[rows][group[0]], i)
                if rep:
                    seconds.setdefault((kernel, rows), []).append(time.perf_counter() - start)
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    lines = [f"| {name} ({mb:.0f} MB float32) | {threads} | " + " | ".join(
        "/".join(f"{1000 * statistics.median(seconds[(k, rows)]):.1f}" for k in kernels) for rows in ROWS
    ) + " |"]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None, help="model folder (config.json)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    from kvboost_rag.default_model import default_model_dir

    folders = [Path(p) for p in args.model] if args.model else [default_model_dir()]
    qwen = Path.home() / ".cache/kvboost-rag/models/qwen2.5-coder-0.5b-instruct"
    if not args.model and qwen.exists():
        folders.append(qwen)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; ms per pass over "
          f"the model's linear layers, median of {args.reps}")
    print()
    print("| model | threads | " + " | ".join(f"{r} rows: F.linear / packed / int8 dynamic / int8 fused / int8 weight-only" for r in ROWS) + " |")
    print("|---|---:|" + "---|" * len(ROWS))
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        for threads in args.threads:
            for line in time_model(folder.name, config, threads, args.reps):
                print(line, flush=True)


if __name__ == "__main__":
    main()
