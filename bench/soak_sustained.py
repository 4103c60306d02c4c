"""Sustained soak: novel RAG queries over a corpus stored on disk, far larger than memory.

A corpus is prewarmed to a disk folder by one engine. A *fresh* engine over the same folder
(no document re-registered: it finds them through their stored records) with a memory budget
far below the corpus's K/V then answers novel queries: each a random subset of the corpus in a
random order behind the system prompt. Per window of queries it records the K/V reuse ratio
(cached prompt tokens / prompt tokens), the process RSS and the index bytes; a sample of
queries is also answered by full prefill and compared (first-token KL, top-1 and greedy
output agreement). The reuse ratio must not decay and RSS must stay flat: a public CacheBlend
store decayed to ~1x within 60-90 novel queries because every query stored new keys and
evicted the documents.

It also times document lookup (finding the documents of a prompt, building its plan) against
the number of documents registered.

Run through ``python bench/soak.py --sustained`` (see ``--help`` for sizes).
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("soak.sustained")

SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below, and keep the answer short."
)
QUESTIONS = [
    "What does the documentation say about this?",
    "Which exceptions can be raised here, and when?",
    "Summarize the key rule in one sentence.",
    "Give a short example that follows these rules.",
]


def corpus(size: int, chars: int) -> list[str]:
    """``size`` documents of at most ``chars`` characters cut from Python's reference topics.

    Each starts with a numbered title (``[i] topic``), so every document has its own start
    even where the corpus is cycled to reach ``size``.
    """
    from kvboost_rag.corpus import python_reference_topics

    pieces: list[tuple[str, str]] = []
    for name, text in python_reference_topics().items():
        piece = ""
        for line in text.splitlines():
            if piece and len(piece) + len(line) + 1 > chars:
                pieces.append((name, piece.strip()))
                piece = ""
            piece += line[:chars] + "\n"
        if piece.strip():
            pieces.append((name, piece.strip()))
    pieces = [p for p in pieces if len(p[1]) >= 64]
    return [f"[{i}] {pieces[i % len(pieces)][0]}\n{pieces[i % len(pieces)][1]}" for i in range(size)]


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class Window:
    """Figures of one window of consecutive queries."""

    queries: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    rss: int = 0
    index_bytes: int = 0
    documents: int = 0

    @property
    def reuse(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def prompt_of(docs: list[str], question: str) -> str:
    return f"{SYSTEM_PROMPT}\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"


def make_engine(args: Any, model: Any, tokenizer: Any, **settings: Any) -> Any:
    from kvboost_rag import KVBoost

    return KVBoost.from_model(
        model,
        tokenizer,
        warm_prefix=SYSTEM_PROMPT + "\n\n",
        chunk_size=args.chunk_size,
        kv_cache_bits=args.kv_bits,
        show_progress=False,
        **settings,
    )


def load_model(args: Any) -> tuple[Any, Any]:
    if args.real:
        from kvboost_rag import KVBoost

        engine = KVBoost.from_pretrained(args.model, show_progress=False)
        return engine.model, engine.tokenizer
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

    return tiny_model("llama"), tiny_tokenizer()


def soak(args: Any, model: Any, tokenizer: Any, disk_dir: str) -> tuple[list[Window], Any, dict[str, float]]:
    """Prewarm the corpus to ``disk_dir``, then run the novel queries on a fresh engine."""
    from kvboost_rag.dev.internals import internals

    docs = corpus(args.corpus_docs, args.corpus_doc_chars)
    start = time.perf_counter()
    writer = make_engine(args, model, tokenizer, disk_cache_dir=disk_dir, max_cache_bytes=64 * 1024**2)
    writer.warm_documents(docs)
    per_doc_bytes = internals(writer).tiers[1].used_bytes / len(docs)
    corpus_bytes = internals(writer).tiers[1].used_bytes
    internals(writer).store.close()
    del writer
    prewarm_s = time.perf_counter() - start
    budget = int(args.memory_mb * 1024**2) if args.memory_mb else max(int(corpus_bytes * args.memory_share), 1)

    attach_start = time.perf_counter()
    engine = make_engine(args, model, tokenizer, disk_cache_dir=disk_dir, max_cache_bytes=budget)
    attach_ms = (time.perf_counter() - attach_start) * 1000
    found = engine.cache_stats().documents
    if found != len(docs):
        raise RuntimeError(f"the fresh engine found {found} of {len(docs)} stored documents")
    engine.warm(SYSTEM_PROMPT + "\n\n")

    rng = random.Random(args.seed)
    windows: list[Window] = []
    checks: list[tuple[Any, Any]] = []
    for q in range(args.queries):
        if q % args.window == 0:
            windows.append(Window())
        chosen = rng.sample(docs, args.docs_per_prompt)
        prompt = prompt_of(chosen, rng.choice(QUESTIONS))
        check = args.check_every > 0 and q % args.check_every == 0
        result = engine.generate(prompt, max_new_tokens=args.new_tokens, return_logits=check)
        if check:
            full = engine.generate(prompt, max_new_tokens=args.new_tokens, reuse=False, return_logits=True)
            checks.append((full, result))
        window = windows[-1]
        window.queries += 1
        window.prompt_tokens += result.prompt_tokens
        window.cached_tokens += result.cached_tokens
        window.ttft_ms.append(result.ttft_ms)
        if window.queries == args.window or q == args.queries - 1:
            stats = engine.cache_stats()
            window.rss, window.index_bytes, window.documents = rss_bytes(), stats.index_bytes, stats.documents
    facts = {
        "corpus_mb": corpus_bytes / 1e6,
        "per_doc_kb": per_doc_bytes / 1e3,
        "budget_mb": budget / 1e6,
        "prewarm_s": prewarm_s,
        "attach_ms": attach_ms,
    }
    return windows, (engine, checks), facts


def lookup_times(args: Any, model: Any, tokenizer: Any, sizes: list[int]) -> list[tuple[int, float, float]]:
    """Median time to find a prompt's documents and to plan it, by documents registered.

    Returns:
        ``(documents, find_ms, plan_ms)`` per size.
    """
    from kvboost_rag.dev.internals import internals
    from kvboost_rag.request.documents import make_record

    rows = []
    for size in sizes:
        docs = corpus(size, args.corpus_doc_chars)
        engine = make_engine(args, model, tokenizer, max_cache_bytes=4 * 1024**3)
        parts = internals(engine)
        for text in docs:
            ids, offsets = engine.token_ids_with_offsets(text)
            parts.cache.index.register(make_record(text, ids, offsets, engine.fingerprint, engine.settings.chunk_size))
        rng = random.Random(size)
        prompts = [prompt_of(rng.sample(docs, args.docs_per_prompt), QUESTIONS[0]) for _ in range(40)]
        find_ms, plan_ms = [], []
        for prompt in prompts:
            tokens = parts.tokenizing.prompt(prompt)
            t0 = time.perf_counter()
            found = parts.cache.index.known_documents().find(prompt)
            t1 = time.perf_counter()
            parts.planner.plan(tokens)
            t2 = time.perf_counter()
            if len(found) != args.docs_per_prompt:
                raise RuntimeError(f"found {len(found)} of {args.docs_per_prompt} documents in a prompt")
            find_ms.append((t1 - t0) * 1000)
            plan_ms.append((t2 - t1) * 1000)
        rows.append((size, statistics.median(find_ms), statistics.median(plan_ms)))
    return rows


def plot(windows: list[Window], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [(i + 1) * window for i in range(len(windows))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(x, [w.reuse for w in windows], marker="o")
    left.set_ylim(0, 1)
    left.set_xlabel("queries")
    left.set_ylabel(f"K/V reuse ratio per {window} queries")
    right.plot(x, [w.rss / 1e6 for w in windows], marker="o", color="tab:orange")
    right.set_ylim(0, max(w.rss for w in windows) / 1e6 * 1.15)
    right.set_xlabel("queries")
    right.set_ylabel("RSS (MB)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run_sustained(args: Any) -> int:
    """The sustained soak and the lookup timing; returns the exit status."""
    from kvboost_rag.diagnosis.correctness import compare_runs

    model, tokenizer = load_model(args)
    with tempfile.TemporaryDirectory(prefix="kvboost-sustained-") as disk_dir:
        windows, (engine, checks), facts = soak(args, model, tokenizer, disk_dir)
        stats = engine.cache_stats()
    print(
        f"\ncorpus: {args.corpus_docs} documents, {facts['corpus_mb']:.1f} MB of K/V on disk "
        f"(prewarmed in {facts['prewarm_s']:.1f} s); memory budget {facts['budget_mb']:.2f} MB; "
        f"a fresh engine was built over the folder and found them all in {facts['attach_ms']:.0f} ms "
        "(fingerprint and key listing)"
    )
    print(f"{args.queries} novel queries of {args.docs_per_prompt} documents each, windows of {args.window}\n")
    print(f"{'queries':>8}{'reuse':>8}{'TTFT ms':>9}{'RSS MB':>9}{'index KB':>10}{'documents':>10}")
    for i, w in enumerate(windows):
        print(
            f"{(i + 1) * args.window:>8}{w.reuse:>8.3f}{statistics.median(w.ttft_ms):>9.1f}"
            f"{w.rss / 1e6:>9.1f}{w.index_bytes / 1e3:>10.1f}{w.documents:>10}"
        )
    tiers = "  ".join(f"{n}: {t['hits']} hits, {t['evictions']} evictions" for n, t in stats.tiers.items())
    print(f"\n{tiers}; memory held {stats.memory_bytes / 1e6:.2f} MB of {facts['budget_mb']:.2f} MB")
    report = compare_runs(checks, kl_tolerance=args.kl_tolerance) if checks else None
    if report is not None:
        print(
            f"checked against full prefill: {len(checks)} queries, mean first-token KL "
            f"{report.mean_first_token_kl:.4f}, top-1 agreement {report.top1_agreement:.2f}, "
            f"identical greedy outputs {report.output_agreement:.2f}"
        )
    first, last = windows[0], windows[-1]
    steady = last.reuse >= first.reuse - args.reuse_slack
    flat = len(windows) < 3 or windows[-1].rss <= windows[1].rss * (1 + args.rss_slack)
    print(
        f"reuse first/last window {first.reuse:.3f}/{last.reuse:.3f}: {'steady' if steady else 'DECAYED'}; "
        f"RSS second/last window {windows[min(1, len(windows) - 1)].rss / 1e6:.1f}/{last.rss / 1e6:.1f} MB: "
        f"{'flat' if flat else 'GROWING'}"
    )
    if args.plot:
        plot(windows, Path(args.plot), args.window)
        print(f"plot: {args.plot}")
    sizes = [int(s) for s in args.lookup_sizes.split(",") if s]
    if sizes:
        print(f"\nlookup of a {args.docs_per_prompt}-document prompt vs documents registered (median of 40 prompts)")
        print(f"{'documents':>10}{'find ms':>9}{'plan ms':>9}")
        for size, find_ms, plan_ms in lookup_times(args, model, tokenizer, sizes):
            print(f"{size:>10}{find_ms:>9.2f}{plan_ms:>9.2f}")
    return 0 if steady and flat else 1


def add_arguments(parser: Any) -> None:
    """Flags of the sustained run (defaults: a scaled run of a few minutes on one thread)."""
    group = parser.add_argument_group("sustained run (--sustained)")
    group.add_argument("--sustained", action="store_true", help="run the sustained soak instead of the mixed one")
    group.add_argument("--corpus-docs", type=int, default=300, help="documents prewarmed to disk (full run: 2000)")
    group.add_argument("--queries", type=int, default=300, help="novel queries (full run: 1000)")
    group.add_argument("--corpus-doc-chars", type=int, default=240, help="characters per corpus document")
    group.add_argument("--window", type=int, default=50, help="queries per point of the curve (full run: 100)")
    group.add_argument("--memory-share", type=float, default=0.05, help="memory budget as a share of the corpus K/V")
    group.add_argument("--check-every", type=int, default=10, help="compare every Nth answer with full prefill (0: never)")
    group.add_argument("--kl-tolerance", type=float, default=0.05)
    group.add_argument("--reuse-slack", type=float, default=0.02, help="largest allowed drop of the reuse ratio")
    group.add_argument("--rss-slack", type=float, default=0.05, help="largest allowed RSS growth after the first window")
    group.add_argument("--lookup-sizes", default="100,1000,10000", help="documents registered for the lookup timing")
    group.add_argument("--plot", default=None, help="write the reuse/RSS curves to this PNG")
