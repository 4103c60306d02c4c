"""Sparse causal attention backends, one layer's call, side by side in one run.

The blend pass runs ~15% of the cached document tokens plus the live tail at scattered
positions over every prompt key; a prefix hit runs the prompt's tail over the cached prefix.
For each case this times one attention call per backend of :mod:`kvboost_rag.attention_backends.sparse`
(``masked_sdpa``: one SDPA call with a boolean mask; ``flex``: one FlexAttention call with a
block mask, compiled on CUDA, PyTorch's eager reference elsewhere; ``blocks``: the loop over
32-query blocks) and prints the median of ``--repeats`` calls and each backend's ratio to
``blocks``. The default backend per device is picked from these numbers.

Run: ``python bench/attention_bench.py`` (CPU, 1 thread); ``--device cuda --dtype bfloat16
--heads 32 --kv-heads 8 --head-dim 128 --lengths 2048,8192,16384`` on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvboost_rag.attention_backends.sparse import (
    BACKENDS,
    query_positions,
    sparse_causal_attention,
    use_backend,
)


def cases(n: int, ratio: float, tail: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Query positions of a blend pass and of a prefix hit over an ``n``-token prompt."""
    body = n - tail
    chosen = torch.randperm(body, generator=generator)[: int(ratio * body)]
    blend = torch.cat([chosen.sort().values, torch.arange(body, n)])
    return {"blend 15%": blend, "prefix hit (last 25%)": torch.arange(n - n // 4, n)}


def time_call(backend: str, q, k, v, positions, repeats: int, device: torch.device) -> float:
    """Median milliseconds of one attention call (first call is a warm-up)."""
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with use_backend(backend), query_positions(positions):
            sparse_causal_attention(None, q, k, v, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lengths", default="1024,2048,4096", help="prompt tokens, comma-separated")
    parser.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backends = args.backends.split(",")
    generator = torch.Generator().manual_seed(0)
    print(
        f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} heads={args.heads}/{args.kv_heads} "
        f"head_dim={args.head_dim}; median of {args.repeats} calls, ms per layer call"
    )
    print("| prompt tokens | case | queries | " + " | ".join(backends) + " | " + " | ".join(f"{b} / blocks" for b in backends if b != "blocks") + " |")
    print("|---" * (3 + len(backends) + len(backends) - ("blocks" in backends)) + "|")
    for n in (int(x) for x in args.lengths.split(",")):
        k = torch.randn(1, args.kv_heads, n, args.head_dim, generator=generator).to(device, dtype)
        v = torch.randn(1, args.kv_heads, n, args.head_dim, generator=generator).to(device, dtype)
        for name, positions in cases(n, 0.15, 64, generator).items():
            q = torch.randn(1, args.heads, positions.numel(), args.head_dim, generator=generator).to(device, dtype)
            ms = {b: time_call(b, q, k, v, positions, args.repeats, device) for b in backends}
            ratios = [f"{ms[b] / ms['blocks']:.2f}" for b in backends if b != "blocks" and "blocks" in ms]
            print(f"| {n} | {name} | {positions.numel()} | " + " | ".join(f"{ms[b]:.2f}" for b in backends) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    main()
