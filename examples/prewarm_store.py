"""Prewarm a K/V store at ingest in one process, answer from it in a fresh one.

Process 1 (``ingest``) reads the corpus once (Python's reference documentation, cut to
1,500 characters per document) and writes the K/V of every document into the disk tier, or
into Redis with ``--redis-url``. Process 2 (``serve``) starts from nothing: it loads the model
(which finds the stored documents by their records), re-runs ``warm_documents`` over the corpus
(which reads those records only: every chunk is already stored), and answers a RAG
prompt whose documents come straight from the store. It prints the TTFT of that first query
next to the TTFT of full prefill of the same prompt, and the time to load a stored token
against the time to compute it.

Run::

    python examples/prewarm_store.py                      # disk tier in a temporary folder
    python examples/prewarm_store.py --store-dir /tmp/kv  # keep the store for another run
    python examples/prewarm_store.py --redis-url redis://127.0.0.1:6379/0
    python examples/prewarm_store.py --tiny --docs 0      # tiny random model, whole corpus

Both processes are started by this script (``python prewarm_store.py`` runs them one after
the other); ``ingest`` and ``serve`` can also be run by hand.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger("prewarm_store")

SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents in the user's message, and keep the answer short."
)
QUESTION = "How does the with statement call __enter__ and __exit__, and what happens on an exception?"
_RESULT_MARK = "PREWARM_RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", nargs="?", choices=["ingest", "serve"], help="run one process only")
    parser.add_argument("--store-dir", type=Path, default=None, help="disk tier folder (default: a temporary one)")
    parser.add_argument("--redis-url", default=None, help="use a Redis tier instead of the disk tier")
    parser.add_argument("--model", default=None, help="local model folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight model (fast, meaningless text)")
    parser.add_argument("--docs", type=int, default=24, help="documents to ingest; 0 for the whole corpus (79)")
    parser.add_argument("--top-k", type=int, default=4, help="documents retrieved into the prompt")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, help="store K/V quantized")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------- shared


def load_engine(args: argparse.Namespace) -> Any:
    """The engine both processes use: same model and settings, so the same cache namespace."""
    import torch

    from kvboost_rag import KVBoost

    if args.threads:
        torch.set_num_threads(args.threads)
    settings: dict[str, Any] = {"kv_cache_bits": args.kv_bits, "show_progress": False}
    if args.redis_url:
        settings["redis_url"] = args.redis_url
    else:
        settings["disk_cache_dir"] = args.store_dir
    if args.tiny:
        from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    else:
        loaded = KVBoost.from_pretrained(args.model, show_progress=False)
        model, tokenizer = loaded.model, loaded.tokenizer
    # Documents are warmed behind the system prompt, as they will appear in prompts.
    return KVBoost.from_model(model, tokenizer, warm_prefix=system_text(tokenizer), **settings)


def system_text(tokenizer: Any) -> str:
    """The templated system turn every prompt starts with."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def corpus(args: argparse.Namespace) -> list[str]:
    from kvboost_rag.corpus import python_reference_documents

    docs = python_reference_documents(max_chars=1500)
    return docs if args.docs <= 0 else docs[: args.docs]


def retrieve(question: str, docs: list[str], k: int) -> list[str]:
    """Top-``k`` documents by word overlap with the question (a stand-in for a vector store)."""
    words = Counter(w for w in re.findall(r"[a-z_]{3,}", question.lower()))

    def score(doc: str) -> float:
        found = Counter(re.findall(r"[a-z_]{3,}", doc.lower()))
        return sum(min(found[w], 3) for w in words) / (1 + len(doc) / 2000)

    return sorted(docs, key=score, reverse=True)[:k]


def build_prompt(engine: Any, docs: list[str], question: str) -> str:
    context = "\n\n".join(docs)
    user = f"Reference documents:\n\n{context}\n\nQuestion: {question}"
    return engine.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}], add_generation_prompt=True
    )


def emit(result: dict[str, Any]) -> None:
    """Hand the phase's figures to the parent process on one stdout line."""
    print(_RESULT_MARK + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------- phases


def ingest(args: argparse.Namespace) -> dict[str, Any]:
    """Read the corpus once and store its K/V."""
    start = time.perf_counter()
    engine = load_engine(args)
    load_s = time.perf_counter() - start
    docs = corpus(args)
    engine.warm(system_text(engine.tokenizer))
    start = time.perf_counter()
    results = engine.warm_documents(docs)
    warm_s = time.perf_counter() - start
    computed = [r for r in results if r.new_tokens]
    stats = engine.cache_stats()
    lower = [name for name in stats.tiers if name != "memory"]
    return {
        "documents": len(docs),
        "tokens": sum(r.num_tokens for r in results),
        "computed_tokens": sum(r.new_tokens for r in results),
        "model_load_s": load_s,
        "warm_s": warm_s,
        "prefill_ms_per_token": 1000 * sum(r.elapsed_ms / 1000 for r in computed) / max(1, sum(r.new_tokens for r in computed)),
        "stored_bytes": {name: stats.tiers[name]["used_bytes"] for name in lower},
    }


def serve(args: argparse.Namespace) -> dict[str, Any]:
    """Start fresh, answer the first query from the store, then the same prompt by full prefill."""
    start = time.perf_counter()
    engine = load_engine(args)
    load_s = time.perf_counter() - start
    docs = corpus(args)
    start = time.perf_counter()
    registered = engine.warm_documents(docs)  # every chunk is stored: reads the records only
    register_s = time.perf_counter() - start
    prompt = build_prompt(engine, retrieve(QUESTION, docs, args.top_k), QUESTION)

    before = engine.cache_stats().tiers
    reused = engine.generate(prompt, max_new_tokens=args.new_tokens)
    after = engine.cache_stats().tiers
    full = engine.generate(prompt, max_new_tokens=args.new_tokens, reuse=False)
    shuffled = build_prompt(engine, retrieve(QUESTION, docs, args.top_k)[::-1], QUESTION)
    again = engine.generate(shuffled, max_new_tokens=args.new_tokens)
    return {
        "model_load_s": load_s,
        "register_s": register_s,
        "computed_at_register": sum(r.new_tokens for r in registered),
        "prompt_tokens": reused.prompt_tokens,
        "cached_tokens": reused.cached_tokens,
        "recomputed_tokens": reused.recomputed_tokens,
        "reuse_ttft_ms": reused.ttft_ms,
        "full_ttft_ms": full.ttft_ms,
        "reordered_ttft_ms": again.ttft_ms,
        "same_output": reused.token_ids == full.token_ids,
        "answer": reused.output_text,
        "tier_hits": {name: after[name]["hits"] - before[name]["hits"] for name in after},
        "load_ms_per_token": store_load_ms_per_token(args, engine),
    }


def store_load_ms_per_token(args: argparse.Namespace, engine: Any) -> float | None:
    """Time to read, verify and decode every stored entry, per token (disk tier only)."""
    if args.redis_url:
        return None
    from kvboost_rag.cache.codec import decode_block
    from kvboost_rag.cache.storage import DiskTier

    tier = DiskTier(args.store_dir, max_bytes=engine.settings.max_disk_bytes)
    tokens, start = 0, time.perf_counter()
    for key in list(tier.keys()):
        entry = tier.get(key)
        if entry is None or entry.metadata.get("kind") == "document":
            continue  # missing, or a document record (text and tokens, no K/V)
        layers, heads, _, head_dim = (int(d) for d in entry.metadata["shape"].split(","))
        block = decode_block(entry, fingerprint=engine.fingerprint, expected_layout=(layers, heads, head_dim))
        tokens += block.num_tokens
    return 1000 * (time.perf_counter() - start) / max(1, tokens)


# ---------------------------------------------------------------------------------- driver


def run_phase(phase: str, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run one phase in a fresh Python process and return its figures."""
    command = [sys.executable, __file__, phase, *argv]
    if args.store_dir is not None and "--store-dir" not in argv:
        command += ["--store-dir", str(args.store_dir)]
    logger.info("starting %s process", phase)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK) :])
    raise RuntimeError(f"{phase} process printed no result")


def report(ingested: dict[str, Any], served: dict[str, Any], where: str) -> None:
    print(f"\nstore: {where}")
    print(
        f"ingest process: {ingested['documents']} documents, {ingested['tokens']} tokens "
        f"({ingested['computed_tokens']} computed) in {ingested['warm_s']:.1f} s; stored bytes "
        + ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in ingested["stored_bytes"].items())
    )
    print(
        f"serve process:  model load {served['model_load_s']:.1f} s, corpus registered in "
        f"{served['register_s'] * 1000:.0f} ms ({served['computed_at_register']} tokens computed)"
    )
    print()
    print(f"{'first query of the fresh process':<36}{'TTFT ms':>10}")
    print(f"{'  reuse from the store':<36}{served['reuse_ttft_ms']:>10.0f}")
    print(f"{'  full prefill (reuse=False)':<36}{served['full_ttft_ms']:>10.0f}")
    print(f"{'  speedup':<36}{served['full_ttft_ms'] / max(served['reuse_ttft_ms'], 1e-9):>9.1f}x")
    print(f"{'next query, documents reordered':<36}{served['reordered_ttft_ms']:>10.0f}")
    print(
        f"\nprompt {served['prompt_tokens']} tokens, {served['cached_tokens']} from the store "
        f"({served['recomputed_tokens']} recomputed by repair); tier hits {served['tier_hits']}; "
        f"same greedy output as full prefill: {served['same_output']}"
    )
    if served["load_ms_per_token"] is not None:
        print(
            f"per token: load from disk {served['load_ms_per_token']:.3f} ms vs prefill "
            f"{ingested['prefill_ms_per_token']:.3f} ms"
        )
    print(f"\nanswer: {served['answer'].strip()!r}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.phase is not None:
        if args.store_dir is None and not args.redis_url:
            raise SystemExit("a single phase needs --store-dir or --redis-url")
        emit(ingest(args) if args.phase == "ingest" else serve(args))
        return
    with tempfile.TemporaryDirectory(prefix="kvboost-store-") as scratch:
        if args.store_dir is None and not args.redis_url:
            args.store_dir = Path(scratch)
        where = args.redis_url or str(args.store_dir)
        ingested = run_phase("ingest", args, argv)
        served = run_phase("serve", args, argv)
        report(ingested, served, where)


if __name__ == "__main__":
    main()
