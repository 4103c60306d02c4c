"""Reuse benchmark: TTFT and quality of each repair strategy against full prefill.

Embedded model (or ``--model PATH``), a system prompt plus ``--docs`` Python reference
documents in shuffled order per prompt, greedy decoding. Every method is timed the same way
(wall time from the call to the first token) in the same run, and compared with full
prefill of the same prompt: first-token KL, top-1 agreement, greedy-output agreement.

Run: ``python bench/reuse_bench.py`` (add ``--quick`` for fewer prompts).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.correctness import first_token_kl

SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below. Quote the relevant rule, keep the answer short, and say so "
    "when the documents do not contain the answer."
)
QUESTIONS = [
    "What does the documentation say about the scope of names?",
    "How does Python evaluate this construct, step by step?",
    "Which exceptions can be raised here, and when?",
    "Summarize the key rule in one sentence.",
    "Give a short example that follows these rules.",
    "What is the difference between the two forms described?",
]
METHODS = [
    ("none", 0.0),
    ("selective", 0.15),
    ("cacheblend", 0.05),
    ("cacheblend", 0.15),
    ("cacheblend", 0.30),
]


def build_prompts(docs: list[str], count: int, per_prompt: int, seed: int) -> list[tuple[str, list[str]]]:
    """Prompts of the system prompt + ``per_prompt`` shuffled documents + a question."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        chosen = rng.sample(docs, per_prompt)
        context = "\n\n".join(chosen)
        prompts.append((f"{SYSTEM_PROMPT}\n\n{context}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:", chosen))
    return prompts


def agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where two greedy outputs agree, up to the first difference."""
    n = max(len(a), len(b), 1)
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--docs", type=int, default=6, help="documents per prompt")
    parser.add_argument("--doc-chars", type=int, default=1500, help="characters per document")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="3 prompts, 16 new tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.prompts, args.new_tokens = 3, 16
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = KVBoost.from_pretrained(args.model, warm_prefix=SYSTEM_PROMPT + "\n\n", show_progress=False)
    device = engine.model.device
    pool = python_reference_documents(max_chars=args.doc_chars)[: max(12, args.docs * 2)]
    prompts = build_prompts(pool, args.prompts, args.docs, args.seed)

    start = time.perf_counter()
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(pool)
    warm_s = time.perf_counter() - start
    engine.generate(prompts[0][0], max_new_tokens=2)  # first-call overheads out of the timings

    rows: dict[str, dict[str, list[float]]] = {}

    def record(name: str, **values: float) -> None:
        for key, value in values.items():
            rows.setdefault(name, {}).setdefault(key, []).append(value)

    prompt_tokens = []
    for prompt, _ in prompts:
        full = engine.generate(prompt, max_new_tokens=args.new_tokens, reuse=False, return_logits=True)
        prompt_tokens.append(full.prompt_tokens)
        record("full prefill", ttft=full.ttft_ms, reuse=0.0, kl=0.0, top1=1.0, greedy=1.0)
        for strategy, ratio in METHODS:
            engine.settings.recompute_strategy = strategy
            engine.settings.recompute_ratio = ratio
            res = engine.generate(prompt, max_new_tokens=args.new_tokens, return_logits=True)
            record(
                f"{strategy} {int(ratio * 100)}%" if strategy != "none" else "none",
                ttft=res.ttft_ms,
                reuse=res.kv_reuse_ratio,
                kl=first_token_kl(full.first_token_logits, res.first_token_logits),
                top1=float(full.first_token_logits.argmax() == res.first_token_logits.argmax()),
                greedy=agreement(full.token_ids, res.token_ids),
            )

    # Documents in the order they were warmed as one shared beginning: an exact prefix hit.
    ordered_prefix = f"{SYSTEM_PROMPT}\n\n" + "\n\n".join(prompts[0][1]) + "\n\n"
    engine.warm(ordered_prefix)
    for question in QUESTIONS[: args.prompts]:
        prompt = f"{ordered_prefix}Question: {question}\nAnswer:"
        full = engine.generate(prompt, max_new_tokens=args.new_tokens, reuse=False, return_logits=True)
        res = engine.generate(prompt, max_new_tokens=args.new_tokens, return_logits=True)
        record("full prefill (ordered)", ttft=full.ttft_ms, reuse=0.0, kl=0.0, top1=1.0, greedy=1.0)
        record(
            "prefix hit (ordered)",
            ttft=res.ttft_ms,
            reuse=res.kv_reuse_ratio,
            kl=first_token_kl(full.first_token_logits, res.first_token_logits),
            top1=float(full.first_token_logits.argmax() == res.first_token_logits.argmax()),
            greedy=float(full.token_ids == res.token_ids),
        )

    base = statistics.median(rows["full prefill"]["ttft"])
    base_ordered = statistics.median(rows["full prefill (ordered)"]["ttft"])
    print(
        f"\nmodel={engine.model_name} device={device} threads={torch.get_num_threads()} "
        f"prompts={args.prompts} prompt_tokens(median)={int(statistics.median(prompt_tokens))} "
        f"docs/prompt={args.docs} warm={warm_s:.1f}s ({len(pool)} docs)\n"
    )
    print("| method | median TTFT ms | speedup | reuse | mean KL | median KL | top-1 | greedy agree |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, vals in rows.items():
        ref = base_ordered if "ordered" in name else base
        ttft = statistics.median(vals["ttft"])
        print(
            f"| {name} | {ttft:.0f} | {ref / ttft:.2f}x | {statistics.mean(vals['reuse']):.2f} | "
            f"{statistics.mean(vals['kl']):.4f} | {statistics.median(vals['kl']):.4f} | "
            f"{statistics.mean(vals['top1']):.2f} | {statistics.mean(vals['greedy']):.2f} |"
        )


if __name__ == "__main__":
    main()
