"""A corpus larger than memory, with default settings: warm N documents, then P RAG prompts.

Default settings and the embedded model (SmolLM2-135M-Instruct, float32 K/V, about 46 KB a
token): ``warm(system prompt)``, ``warm_documents`` of N documents of about 400 tokens, then P
prompts, each the system prompt, 6 of those documents (random, shuffled) and a question. It
prints what the cache kept and where, the prompts' reuse share, the TTFT against full prefill
(measured on a sample of the prompts), the process's resident memory and the disk tier's bytes.

Documents: Python's reference topics (``pydoc_data.topics``, 79 topics, ~2,600 paragraphs)
read as one stream of paragraphs; document ``i`` is the window of whole paragraphs starting at
paragraph ``start_i`` (starts spread evenly over the stream) and running to about
``--doc-chars`` characters. Neighbouring windows overlap in text but start differently, so
they are distinct documents to the cache (as overlapping chunks of one source are in RAG).

The automatic disk tier goes to a fresh temporary folder (``KVBOOST_RAG_KV_CACHE``) unless
``--kv-cache`` names one, so a run starts empty and leaves the user's cache alone;
``--no-disk`` turns it off (memory only: what a corpus larger than ``max_cache_bytes`` did
before the disk tier was a default). ``--out`` also writes the report (command, machine, table)
to a markdown file.

Usage::

    python bench/corpus_bench.py --docs 1000 --prompts 200 --full-sample 10
    python bench/corpus_bench.py --docs 135 --prompts 20 --no-disk
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM_PROMPT = "You are a careful assistant. Answer only from the documents below."
QUESTIONS = (
    "What does it say?",
    "Which statement is described first?",
    "Summarise the rules in one sentence.",
    "What happens when an exception is raised?",
)


def corpus(count: int, doc_chars: int) -> list[str]:
    """``count`` distinct documents of about ``doc_chars`` characters (windows of paragraphs)."""
    from kvboost_rag.corpus import python_reference_topics

    paragraphs = [p.strip() for text in python_reference_topics().values() for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs: list[str] = []
    seen: set[str] = set()
    step = max(1, len(paragraphs) // max(1, count))
    start = 0
    while len(docs) < count:
        if start >= len(paragraphs):
            start = (start % step) + 1  # another pass, shifted
            if start >= step:
                break
        window: list[str] = []
        i = start
        while i < len(paragraphs) and sum(len(p) + 2 for p in window) < doc_chars:
            window.append(paragraphs[i])
            i += 1
        text = "\n\n".join(window)[:doc_chars].rstrip()
        if len(text) >= doc_chars // 2 and text[:64] not in seen:
            seen.add(text[:64])
            docs.append(text)
        start += step
    return docs


def rag_prompt(docs: list[str], question: str) -> str:
    """The default template: system prompt, documents, question."""
    return SYSTEM_PROMPT + "\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"


def rss_mib() -> float:
    """Resident memory of this process now (MiB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def machine_line(threads: int) -> str:
    """CPU, cores, library versions and load: the line naming where the figures come from."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {threads} thread(s), "
        f"transformers {transformers.__version__}, Python {platform.python_version()}, load average at start {load}"
    )


def git_revision() -> str:
    """The checked-out commit (short), or ``unknown``."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1000, help="documents warmed")
    parser.add_argument("--doc-chars", type=int, default=1600, help="characters per document (~400 tokens)")
    parser.add_argument("--prompts", type=int, default=200, help="RAG prompts after the warm")
    parser.add_argument("--per-prompt", type=int, default=6, help="documents per prompt")
    parser.add_argument("--full-sample", type=int, default=10, help="prompts also run with full prefill")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache", type=Path, default=None, help="folder of the automatic disk tier")
    parser.add_argument("--no-disk", action="store_true", help="no disk tier (memory only)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    parser.add_argument("--json", type=Path, default=None, help="write every prompt's figures to this JSON file")
    args = parser.parse_args()

    kv_dir = args.kv_cache or Path(tempfile.mkdtemp(prefix="kvboost-corpus-bench-"))
    os.environ["KVBOOST_RAG_KV_CACHE"] = "off" if args.no_disk else str(kv_dir)
    try:
        run(args, kv_dir)
    finally:
        if args.kv_cache is None:
            shutil.rmtree(kv_dir, ignore_errors=True)  # a temporary folder: gigabytes of K/V


def run(args: argparse.Namespace, kv_dir: Path) -> None:
    """Warm the corpus, run the prompts, print (and with ``--out`` write) the report."""
    import torch

    from kvboost_rag import KVBoost

    torch.set_num_threads(args.threads)
    machine, revision = machine_line(args.threads), git_revision()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvboost_rag.engine").setLevel(logging.INFO)

    docs = corpus(args.docs, args.doc_chars)
    engine = KVBoost.from_pretrained(show_progress=True)
    tokens = [engine.count_tokens(d) for d in docs]
    print(f"{len(docs)} documents, {statistics.mean(tokens):.0f} tokens each on average ({sum(tokens)} in all)")
    engine.warm(SYSTEM_PROMPT + "\n\n")
    start = time.perf_counter()
    results = engine.warm_documents(docs)
    warm_s = time.perf_counter() - start
    kept = sum(1 for r in results if r.kept_in)
    stats = engine.cache_stats()
    rss_after_warm = rss_mib()

    rng = random.Random(args.seed)
    reuse, ttft, full, paired, lengths = [], [], [], [], []
    records: list[dict[str, float | int | None]] = []
    sample = set(rng.sample(range(args.prompts), min(args.full_sample, args.prompts)))
    for i in range(args.prompts):
        chosen = rng.sample(docs, args.per_prompt)
        prompt = rag_prompt(chosen, QUESTIONS[i % len(QUESTIONS)])
        result = engine.generate(prompt, max_new_tokens=1)
        reuse.append(result.kv_reuse_ratio)
        lengths.append(result.prompt_tokens)
        ttft.append(result.ttft_ms)
        baseline = engine.generate(prompt, max_new_tokens=1, reuse=False) if i in sample else None
        if baseline is not None:
            full.append(baseline.ttft_ms)
            paired.append(baseline.ttft_ms / result.ttft_ms)
        records.append(
            {
                "prompt": i,
                "tokens": result.prompt_tokens,
                "documents_found": result.documents_found,
                "reuse": result.kv_reuse_ratio,
                "ttft_ms": result.ttft_ms,
                "full_prefill_ttft_ms": baseline.ttft_ms if baseline is not None else None,
                "load_average_1m": os.getloadavg()[0],
            }
        )
    after = engine.cache_stats()
    disk = folder_bytes(kv_dir)

    rows = [
        ("documents warmed", f"{len(docs)} (~{statistics.mean(tokens):.0f} tokens, {sum(tokens)} tokens in all)"),
        ("warm time", f"{warm_s:.0f} s ({warm_s / len(docs) * 1000:.0f} ms a document)"),
        ("kept after the warm", f"{kept} of {len(docs)} ({', '.join(f'{k} {v}' for k, v in stats.documents_by_tier.items())})"),
        ("documents evicted (whole)", f"{stats.documents_evicted} after the warm, {after.documents_evicted} after the prompts"),
        ("prompts", f"{args.prompts} of {args.per_prompt} documents, {statistics.mean(lengths):.0f} tokens on average"),
        ("reuse share (kv_reuse_ratio)", f"median {statistics.median(reuse):.2f}, min {min(reuse):.2f}, mean {statistics.mean(reuse):.2f}"),
        ("TTFT with reuse", f"median {statistics.median(ttft):.0f} ms, p90 {sorted(ttft)[int(0.9 * (len(ttft) - 1))]:.0f} ms"),
        ("TTFT full prefill", f"median {statistics.median(full):.0f} ms over {len(full)} sampled prompts" if full else "-"),
        ("TTFT ratio (full / reuse)", f"median {statistics.median(paired):.2f}x on the sample" if paired else "-"),
        ("resident memory", f"{rss_after_warm:.0f} MiB after the warm, {rss_mib():.0f} MiB after the prompts, "
         f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"),
        ("memory tier", f"{after.memory_bytes / 1024**2:.0f} MiB, {after.entries} entries"),
        ("disk tier", "off" if args.no_disk else f"{disk / 1024**2:.0f} MiB in {kv_dir}"),
        ("memory / disk hits", f"{after.tiers.get('memory', {}).get('hits', 0)} / {after.tiers.get('disk', {}).get('hits', 0)}"),
        ("torch threads", str(torch.get_num_threads())),
        ("load average at the end", ", ".join(f"{x:.1f}" for x in os.getloadavg())),
    ]
    width = max(len(name) for name, _ in rows)
    table = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    table += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    print()
    print("\n".join(table))
    sys.stdout.flush()
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1))
    if args.out is not None:
        command = "python bench/corpus_bench.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        report = [
            "# A corpus larger than memory, default settings",
            "",
            f"Command: `{command}`",
            "",
            f"Machine: {machine}",
            "",
            f"Code: git {revision}",
            "",
            *table,
            "",
        ]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report))


if __name__ == "__main__":
    main()
