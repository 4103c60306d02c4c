"""One ``generate_batch`` of RAG chat prompts against the same prompts one after another.

The server bench's shape of request in process (``bench/server_load.py``): ``--prompts`` chat
prompts, each the system turn with ``--docs`` of Python's reference topics (``--doc-chars``
each, drawn from a pool of ``--pool`` warmed first) and a question in the user turn; greedy,
``--new-tokens`` tokens. Every prompt runs once untimed first (so both timed runs start from
the same cache), then one after another with ``generate``, then in one ``generate_batch``;
prints both wall times, their ratio and how many outputs are identical.

Run: ``python bench/batch_chat_bench.py --threads 2``; ``PYTHONPATH=<other checkout>`` times
another checkout's engine on the same prompts.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import time

import torch

import kvboost_rag
from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents

logger = logging.getLogger("batch_chat_bench")

SYSTEM = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below, and keep the answer short."
)


def chat_prompts(engine: KVBoost, pool: list[str], count: int, docs: int, rng: random.Random) -> list[str]:
    """``count`` chat prompts of ``docs`` documents of ``pool`` each, in a new order each."""
    prompts = []
    for i in range(count):
        chosen = rng.sample(pool, docs)
        question = f"Question {i}: what do these documents say about statement number {i}?"
        messages = [{"role": "system", "content": SYSTEM + "\n\n" + "\n\n".join(chosen)}, {"role": "user", "content": question}]
        prompts.append(engine.apply_chat_template(messages))
    return prompts


def run(args: argparse.Namespace) -> str:
    """Both timed runs; the report's lines."""
    torch.set_num_threads(args.threads)
    corpus = python_reference_documents(max_chars=args.doc_chars)
    rng = random.Random(args.seed)
    rng.shuffle(corpus)
    engine = KVBoost.from_pretrained(args.model, show_progress=False)
    pool = corpus[: args.pool]
    engine.warm_documents(pool)
    prompts = chat_prompts(engine, pool, args.prompts, args.docs, rng)
    for prompt in prompts:
        engine.generate(prompt, max_new_tokens=2)
    start = time.perf_counter()
    alone = [engine.generate(prompt, max_new_tokens=args.new_tokens) for prompt in prompts]
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    batch = engine.generate_batch(prompts, max_new_tokens=args.new_tokens)
    batched = time.perf_counter() - start
    same = sum(a.token_ids == b.token_ids for a, b in zip(alone, batch))
    tokens = sorted(len(engine.tokenizer(p)["input_ids"]) for p in prompts)
    return "\n".join([
        f"batch_chat_bench: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__} with {args.threads} thread(s); kvboost_rag from {os.path.dirname(kvboost_rag.__file__)}; "
        f"small-row kernel {engine.small_row_kernel}",
        f"{args.prompts} chat prompts of {args.docs} documents ({tokens[0]}-{tokens[-1]} tokens), {args.new_tokens} new tokens, greedy",
        f"one after another {sequential:.1f} s; one generate_batch {batched:.1f} s: {batched / sequential:.2f}x; "
        f"identical outputs {same}/{len(prompts)}",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--docs", type=int, default=6, help="documents per prompt")
    parser.add_argument("--doc-chars", type=int, default=1400)
    parser.add_argument("--pool", type=int, default=24, help="documents warmed first")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(run(args))


if __name__ == "__main__":
    main()
