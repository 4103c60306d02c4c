"""How soon a call ends after its last token, and whether the next request finds what it stored.

For each round this streams one RAG prompt of documents the engine has never read (passed as
``documents=``, so they are cut on their boundaries and stored by the write-back), then asks
again with the same documents in a new order. It prints, per round:

- ``tail_ms``: wall time from the moment the last text piece was received to the end of the
  iteration (what a streaming client waits for after the answer);
- ``found``: share of the second prompt's document tokens found in the cache
  (``content_hit_tokens`` over the tokens of its documents), and the share of its tokens read
  from cache (``cached_tokens`` over ``prompt_tokens``: the repair's recomputed tokens and the
  question are not);
- ``flush_ms``: how long ``engine.flush()`` then still waited for the tiers.

Run: ``python bench/writeback_bench.py [--threads 2] [--rounds 3] [--disk]`` (``--disk``: a
write-through disk tier in a temporary folder, so every stored entry is also serialized).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag_bench import machine_line

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents

SYSTEM = "You answer questions about Python using only the reference documents below."


def _prompt(engine: KVBoost, documents: list[str], question: str) -> str:
    context = "\n\n".join(documents)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{context}\n\nQuestion: {question}"}]
    return engine.apply_chat_template(messages)


def _documents_for(pool: list[str], engine: KVBoost, target_tokens: int) -> list[str]:
    """Documents from the front of ``pool`` (removed from it) up to about ``target_tokens``."""
    chosen: list[str] = []
    total = 0
    while pool and total < target_tokens:
        text = pool.pop(0)
        chosen.append(text)
        total += engine.count_tokens(text)
    return chosen


def _streamed_tail(engine: KVBoost, prompt: str, documents: list[str], new_tokens: int) -> tuple[float, int]:
    """(ms from the last piece to the end of the iteration, prompt tokens)."""
    stream = engine.stream(prompt, max_new_tokens=new_tokens, documents=documents)
    last = time.perf_counter()
    for _ in stream:
        last = time.perf_counter()
    end = time.perf_counter()
    assert stream.result is not None
    return (end - last) * 1000, stream.result.prompt_tokens


def _round(engine: KVBoost, pool: list[str], target: int, new_tokens: int, rng: random.Random) -> dict[str, float]:
    documents = _documents_for(pool, engine, target)
    tail_ms, prompt_tokens = _streamed_tail(engine, _prompt(engine, documents, "What do these sections say?"), documents, new_tokens)
    shuffled = documents[:]
    rng.shuffle(shuffled)
    again = engine.generate(_prompt(engine, shuffled, "Which section is longest?"), max_new_tokens=4, documents=shuffled)
    document_tokens = sum(engine.count_tokens(d) for d in shuffled)
    start = time.perf_counter()
    getattr(engine, "flush", lambda: None)()  # engines before the write-behind had none
    flush_ms = (time.perf_counter() - start) * 1000
    return {
        "prompt_tokens": prompt_tokens,
        "tail_ms": tail_ms,
        "found": again.content_hit_tokens / document_tokens,
        "cached": again.cached_tokens / again.prompt_tokens,
        "flush_ms": flush_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=6600, help="document tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--disk", action="store_true", help="a write-through disk tier")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvboost-writeback-") as folder:
        _run(args, folder if args.disk else None)


def _run(args: argparse.Namespace, folder: str | None) -> None:
    """The rounds and their table (``folder``: a write-through disk tier there)."""
    settings = {"disk_cache_dir": folder} if folder else {}
    engine = KVBoost.from_pretrained(None, **settings)
    pool = python_reference_documents(max_chars=1600)
    random.Random(0).shuffle(pool)
    rng = random.Random(1)
    engine.generate(_prompt(engine, pool[-2:], "Warm-up."), max_new_tokens=2)  # first-call costs
    rows = [_round(engine, pool, args.tokens, args.new_tokens, rng) for _ in range(args.rounds)]
    print(f"# write-back bench: {machine_line()}; disk tier: {'write-through' if folder else 'default'}")
    print("| round | prompt tokens | tail after last piece (ms) | document tokens found after reorder | "
          "prompt tokens read from cache | flush waited (ms) |")
    print("|---|---|---|---|---|---|")
    for i, row in enumerate(rows):
        print(f"| {i} | {row['prompt_tokens']:.0f} | {row['tail_ms']:.1f} | {row['found']:.2f} | {row['cached']:.2f} | "
              f"{row['flush_ms']:.1f} |")
    print(f"median tail {statistics.median(r['tail_ms'] for r in rows):.1f} ms, "
          f"median found {statistics.median(r['found'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
