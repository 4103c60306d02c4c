"""Soak: hundreds of mixed warm/generate calls through a small memory tier backed by disk.

The workload is a list of rounds. Each round warms a few new documents (and re-warms one
already stored), then generates answers to prompts made of the system prompt, documents
warmed so far in a random order, and a question. Within a round the calls run concurrently
on ``--workers`` threads; rounds run one after the other, so every prompt's documents are
stored before it runs and each answer is fixed by the workload alone.

The same workload runs twice: first sequentially on a reference engine whose memory tier
holds everything, then concurrently on an engine whose memory budget is a small fraction of
the corpus's K/V (so entries are evicted to disk and promoted back on hits). Every answer of
the soak run must be token-for-token the answer of the sequential reference.

Run: ``python bench/soak.py`` (tiny random-weight model, about a minute), or
``python bench/soak.py --real`` for the embedded SmolLM2-135M-Instruct.

``python bench/soak.py --sustained`` runs the sustained soak instead
(:mod:`soak_sustained`): novel RAG queries over a corpus prewarmed to disk and far larger than
memory, read by a fresh engine; the reuse ratio per window must not decay and RSS must stay
flat. Its defaults are a scaled run of a few minutes on one thread; the full run is
``--sustained --corpus-docs 2000 --queries 1000 --window 100``.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from soak_sustained import add_arguments as add_sustained_arguments
from soak_sustained import run_sustained

logger = logging.getLogger("soak")

SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below, and keep the answer short."
)
QUESTIONS = [
    "What does the documentation say about the scope of names?",
    "Which exceptions can be raised here, and when?",
    "Summarize the key rule in one sentence.",
    "Give a short example that follows these rules.",
]


@dataclass
class Round:
    """Documents to warm, then prompts to answer (indices into the workload's prompt list)."""

    warm: list[str] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)


@dataclass
class Workload:
    rounds: list[Round]
    prompts: list[str]

    @property
    def calls(self) -> int:
        return sum(len(r.warm) + len(r.prompts) for r in self.rounds)


def build_workload(docs: list[str], calls: int, per_prompt: int, seed: int) -> Workload:
    """Rounds of 3 new documents + 1 re-warm, then 8 prompts, until ``calls`` calls."""
    rng = random.Random(seed)
    pool = list(docs)
    rng.shuffle(pool)
    warmed: list[str] = []
    rounds: list[Round] = []
    prompts: list[str] = []
    made = 0
    while made < calls:
        round_ = Round()
        fresh = [pool.pop() for _ in range(min(3, len(pool)))]
        round_.warm = fresh + ([rng.choice(warmed)] if warmed else [])
        warmed += fresh
        for _ in range(8):
            chosen = rng.sample(warmed, min(per_prompt, len(warmed)))
            question = QUESTIONS[len(prompts) % len(QUESTIONS)]
            context = "\n\n".join(chosen)
            prompts.append(f"{SYSTEM_PROMPT}\n\n{context}\n\nQuestion: {question}\nAnswer:")
            round_.prompts.append(len(prompts) - 1)
        rounds.append(round_)
        made += len(round_.warm) + len(round_.prompts)
    return Workload(rounds, prompts)


def run(engine: Any, workload: Workload, new_tokens: int, workers: int) -> tuple[dict[int, list[int]], float]:
    """Run the workload; ``workers == 1`` runs it strictly in order.

    Returns:
        Generated token ids per prompt index, and the wall time in seconds.
    """
    answers: dict[int, list[int]] = {}
    start = time.perf_counter()

    def answer(index: int) -> tuple[int, list[int]]:
        return index, engine.generate(workload.prompts[index], max_new_tokens=new_tokens).token_ids

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for round_ in workload.rounds:
            if workers == 1:
                for doc in round_.warm:
                    engine.warm_documents([doc])
                answers.update(answer(i) for i in round_.prompts)
            else:
                list(pool.map(lambda doc: engine.warm_documents([doc]), round_.warm))
                answers.update(pool.map(answer, round_.prompts))
    return answers, time.perf_counter() - start


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Settings shared by the reference and the soak engine (same cache namespace)."""
    return {
        "warm_prefix": SYSTEM_PROMPT,
        "kv_cache_bits": args.kv_bits,
        "chunk_size": args.chunk_size,
        "show_progress": False,
    }


def make_reference(args: argparse.Namespace) -> tuple[Any, Any]:
    """The reference engine (memory holds everything) and a factory of the soak model."""
    from kvboost_rag import KVBoost

    if args.real:
        reference = KVBoost.from_pretrained(args.model, max_cache_bytes=8 * 1024**3, **engine_settings(args))
        model = reference.model
        return reference, lambda: model  # the two runs never overlap
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

    reference = KVBoost.from_model(tiny_model("llama"), tiny_tokenizer(), max_cache_bytes=8 * 1024**3, **engine_settings(args))
    return reference, lambda: tiny_model("llama")  # same seed, same weights


def make_soak(args: argparse.Namespace, model: Any, tokenizer: Any, memory_bytes: int, disk_dir: str) -> Any:
    """The soak engine: a small memory tier over a disk tier."""
    from kvboost_rag import KVBoost

    return KVBoost.from_model(
        model,
        tokenizer,
        max_cache_bytes=memory_bytes,
        disk_cache_dir=disk_dir,
        max_disk_bytes=int(args.disk_mb * 1024**2),
        **engine_settings(args),
    )


def report(workload: Workload, ref: dict[int, list[int]], soak: dict[int, list[int]], ref_s: float, soak_s: float, engine: Any) -> bool:
    stats = engine.cache_stats()
    mismatched = [i for i in ref if soak.get(i) != ref[i]]
    warms = sum(len(r.warm) for r in workload.rounds)
    print(f"\ncalls: {workload.calls} ({warms} warm, {len(workload.prompts)} generate) in {len(workload.rounds)} rounds")
    print(f"time: sequential reference {ref_s:.1f} s, soak {soak_s:.1f} s")
    print()
    print(f"{'tier':<8}{'hits':>8}{'evictions':>11}{'MB held':>10}")
    for name, tier in stats.tiers.items():
        print(f"{name:<8}{tier['hits']:>8}{tier['evictions']:>11}{tier['used_bytes'] / 1e6:>10.1f}")
    print(f"{'misses':<8}{stats.misses:>8}")
    counters = stats.counters
    print(
        f"\nprompt tokens {counters.get('prompt_tokens', 0)}, prefix hits {counters.get('prefix_hit_tokens', 0)}, "
        f"content hits {counters.get('content_hit_tokens', 0)}, corrupt entries {counters.get('corrupt_entries', 0)}"
    )
    print(f"answers matching the sequential reference: {len(ref) - len(mismatched)}/{len(ref)}")
    if mismatched:
        print(f"MISMATCHED prompts: {mismatched[:20]}")
    return not mismatched and stats.tiers["memory"]["evictions"] > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="embedded SmolLM2-135M-Instruct instead of the tiny model")
    parser.add_argument("--model", default=None, help="local model folder (with --real)")
    parser.add_argument("--calls", type=int, default=300, help="warm + generate calls")
    parser.add_argument("--docs-per-prompt", type=int, default=3)
    parser.add_argument("--doc-chars", type=int, default=800)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4, help="threads of the soak run")
    parser.add_argument("--memory-mb", type=float, default=None, help="memory tier budget (default: ~1/8 of the corpus K/V)")
    parser.add_argument("--disk-mb", type=float, default=20 * 1024)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    add_sustained_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    import torch

    from kvboost_rag.corpus import python_reference_documents

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sustained:
        return run_sustained(args)
    docs = python_reference_documents(max_chars=args.doc_chars)
    workload = build_workload(docs, args.calls, args.docs_per_prompt, args.seed)
    reference, soak_model = make_reference(args)
    reference.warm(SYSTEM_PROMPT)
    ref_answers, ref_s = run(reference, workload, args.new_tokens, workers=1)
    ref_bytes = reference.cache_stats().memory_bytes
    budget = int(args.memory_mb * 1024**2) if args.memory_mb else max(ref_bytes // 8, 1)
    with tempfile.TemporaryDirectory(prefix="kvboost-soak-") as disk_dir:
        soak = make_soak(args, soak_model(), reference.tokenizer, budget, disk_dir)
        if soak.fingerprint != reference.fingerprint:
            raise RuntimeError("reference and soak engines have different fingerprints")
        soak.warm(SYSTEM_PROMPT)
        soak_answers, soak_s = run(soak, workload, args.new_tokens, workers=args.workers)
        ok = report(workload, ref_answers, soak_answers, ref_s, soak_s, soak)
        print(f"memory budget {budget / 1e6:.1f} MB; the reference held {ref_bytes / 1e6:.1f} MB of K/V")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
