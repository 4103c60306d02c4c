"""Scale benchmark: warm throughput on 1 and 2 workers, lookup latency per tier, bytes per token.

Three tables (a benchmark, not a timed test):

1. **Warm throughput**: ``warm_corpus`` over real reference text with the embedded
   SmolLM2-135M-Instruct, into a Redis Cluster, in one process (1 worker) and on 2 Ray
   workers; documents/s and tokens/s once the workers are ready (model loading apart).
2. **Lookup latency**: median and p90 time to read and verify one stored chunk
   (``chunk_size`` tokens of SmolLM2's K/V at the chosen ``kv_cache_bits``) from the memory
   tier, the disk tier, one Redis server and a 3-master Redis Cluster (all on this machine,
   loopback).
3. **Bytes per token** stored at each ``kv_cache_bits`` for SmolLM2-135M (float32 on CPU) and
   for an 8B Llama-3 shape (bfloat16; 32 layers, 8 KV heads, head dim 128), as serialized.

Run::

    python bench/scale_bench.py                    # all three (a few minutes on 2 CPU cores)
    python bench/scale_bench.py --skip-warm        # latency and bytes only (seconds)
    python bench/scale_bench.py --docs 60 --threads 1 --out bench/results/scale.md

Needs Debian's redis-server/redis-cli (``bash .ci/install-redis.sh``) and, for 2 workers,
``pip install 'kvboost-rag[ray]'``.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.cache.codec import KVBlock, encode_block
from kvboost_rag.cache.storage import DiskTier, MemoryTier, StorageTier, serialize_entry
from kvboost_rag.cache.storage.redis_tier import RedisTier

logger = logging.getLogger("scale_bench")

#: (layers, KV heads, head dim, dtype) of the models the byte table covers.
SHAPES = {
    "SmolLM2-135M (float32)": (30, 3, 64, torch.float32),
    "Llama-3-8B shape (bfloat16)": (32, 8, 128, torch.bfloat16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=48, help="documents warmed per run")
    parser.add_argument("--max-chars", type=int, default=1200, help="characters per document")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--chunk-size", type=int, default=128, help="tokens per stored chunk (lookup table)")
    parser.add_argument("--lookups", type=int, default=60, help="lookups timed per tier")
    parser.add_argument("--skip-warm", action="store_true", help="leave out the warm throughput table")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables (markdown) here")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------- bytes per token


def _block(layers: int, heads: int, head_dim: int, dtype: torch.dtype, tokens: int) -> KVBlock:
    shape = (layers, heads, tokens, head_dim)
    gen = torch.Generator().manual_seed(0)
    return KVBlock(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype),
                   torch.arange(tokens), 0)


def bytes_per_token(tokens: int) -> list[list[str]]:
    rows = []
    for name, (layers, heads, head_dim, dtype) in SHAPES.items():
        block = _block(layers, heads, head_dim, dtype, tokens)
        cells = [name]
        for bits in (None, 8, 4):
            entry = encode_block(block, fingerprint="bench", bits=bits)
            cells.append(f"{len(serialize_entry(entry, key='k')) / tokens:,.0f}")
        rows.append(cells)
    return rows


# ------------------------------------------------------------------------------- lookup latency


def _time_gets(tier: StorageTier, keys: list[str]) -> tuple[float, float]:
    for key in keys[:3]:
        tier.get(key)  # warm connections and caches
    times = []
    for key in keys:
        start = time.perf_counter()
        assert tier.get(key) is not None, f"{tier.name}: {key} missing"
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def lookup_latency(args: argparse.Namespace, bits: int | None) -> list[list[str]]:
    from kvboost_rag.dev.redis_local import start_cluster, start_server

    layers, heads, head_dim, dtype = SHAPES["SmolLM2-135M (float32)"]
    entry = encode_block(_block(layers, heads, head_dim, dtype, args.chunk_size), fingerprint="bench", bits=bits)
    size = len(serialize_entry(entry, key="k"))
    keys = [f"{i:064x}" for i in range(args.lookups)]
    folder = Path(tempfile.mkdtemp(prefix="kvboost-scale-bench-"))
    server = start_server()
    cluster = start_cluster(3, persistent=False)
    tiers: list[tuple[str, StorageTier]] = [
        ("memory", MemoryTier(10 * size * len(keys))),
        ("disk (local, page cache warm)", DiskTier(folder, 10 * size * len(keys))),
        ("Redis, one server (loopback)", RedisTier(server.url, key_prefix="bench:")),
        ("Redis Cluster, 3 masters (loopback)", RedisTier(cluster.url, key_prefix="bench:")),
    ]
    rows = []
    try:
        for name, tier in tiers:
            for key in keys:
                tier.put(key, entry)
            median, p90 = _time_gets(tier, keys)
            rows.append([name, f"{size / 1e6:.2f}", f"{median:.3f}", f"{p90:.3f}"])
            tier.clear()
            tier.close()
    finally:
        server.stop()
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------- warm throughput


def warm_throughput(args: argparse.Namespace) -> list[list[str]]:
    from kvboost_rag.corpus import python_reference_documents
    from kvboost_rag.dev.redis_local import start_cluster
    from kvboost_rag.warm_job import EngineSpec, warm_corpus

    docs = python_reference_documents(max_chars=args.max_chars)[: args.docs]
    rows = []
    for workers in (1, 2):
        cluster = start_cluster(3, persistent=False)  # an empty store for each run
        try:
            spec = EngineSpec(settings={"redis_url": cluster.url, "disk_cache_dir": None}, threads=args.threads)
            report = warm_corpus(docs, spec, workers=workers, batch_size=4, backend="local" if workers == 1 else "ray")
        finally:
            cluster.stop()
        assert not report.failures, report.failures
        logger.info("%d worker(s): %s", workers, report.summary())
        rows.append([f"{workers} ({report.backend})", str(report.computed), str(report.computed_tokens),
                     f"{report.startup_seconds:.1f}", f"{report.warm_seconds:.1f}", f"{report.documents_per_second:.2f}",
                     f"{report.tokens_per_second:.0f}", f"{report.bytes_written / report.computed_tokens:,.0f}"])
    return rows


# ------------------------------------------------------------------------------- output


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(args.threads)
    parts = [
        f"command: python bench/scale_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip(),
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} torch thread(s) per worker",
        "",
        "bytes per token stored (serialized, with headers)",
        table(["model", "kv_cache_bits=None (model dtype)", "kv_cache_bits=8", "kv_cache_bits=4"], bytes_per_token(args.chunk_size)),
    ]
    for bits in (None, 8):
        parts += ["", f"lookup of one {args.chunk_size}-token SmolLM2 chunk (kv_cache_bits={bits}), ms",
                  table(["tier", "entry MB", "median", "p90"], lookup_latency(args, bits))]
    if not args.skip_warm:
        parts += ["", f"warm throughput: {args.docs} reference documents (<= {args.max_chars} chars), SmolLM2-135M, "
                  "into a 3-master Redis Cluster",
                  table(["workers", "documents", "tokens", "startup s", "warm s", "documents/s", "tokens/s",
                         "bytes/token written"], warm_throughput(args))]
    text = "\n".join(parts)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
