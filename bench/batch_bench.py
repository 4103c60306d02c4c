"""Batch benchmark: batched decoding against one request at a time, and throughput under load.

Embedded model (or ``--model PATH``; ``--model tiny`` for a smoke run on a random 3-layer
llama). RAG prompts as in ``bench/reuse_bench.py`` (a question of ``bench/qa.json`` over its
document plus distractors, shuffled, behind the system prompt), documents prewarmed, and one
untimed pass over the prompts first so every timed run starts from the same cache.

0. One decode step (one forward pass, each sequence over its own cache) against the number of
   sequences in it, at each concurrency level of part 2.
1. ``--prompts`` prompts x ``--new-tokens`` greedy tokens: ``generate`` one after another
   against one ``generate_batch`` call; wall time, ratio, and whether every output is
   identical.
2. Throughput (generated tokens per second of wall time) of ``--requests`` requests at each
   concurrency of ``--concurrency``: the engine (that many threads calling ``generate``),
   LangChain ``KVBoostLLM.batch(..., config={"max_concurrency": c})``, LlamaIndex
   ``KVBoostLLM.acomplete`` with at most ``c`` calls in flight, and LangChain's
   ``HuggingFacePipeline`` with ``batch_size=c`` (transformers' padded batch generation, no
   reuse).
3. TTFT under a steady arrival rate: ``--arrivals`` requests, one every ``1 / --rate``
   seconds, each in its own thread, with continuous batching and with one request at a time
   (``max_batch_size=1``); TTFT is wall time from each call to its first token.

Tables print as Markdown; ``--out`` receives ``batch_throughput.png``.

Run: ``python bench/batch_bench.py --threads 1 --out bench/results``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reuse_bench import SYSTEM_PROMPT, build_prompts

from kvboost_rag import KVBoost

logger = logging.getLogger(__name__)


@dataclass
class BatchRow:
    """Part 1: the same prompts one by one and as one batch."""

    prompts: int
    new_tokens: int
    sequential_s: float
    batch_s: float
    identical: int

    @property
    def ratio(self) -> float:
        """Batch wall time over sequential wall time."""
        return self.batch_s / self.sequential_s


@dataclass
class StepRow:
    """Part 0: one batched decode step at one batch size."""

    batch: int
    step_ms: float

    @property
    def ms_per_token(self) -> float:
        """Step time per sequence in the batch."""
        return self.step_ms / self.batch


@dataclass
class ThroughputRow:
    """Part 2: one system at one concurrency."""

    system: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.tokens / self.wall_s


@dataclass
class LoadRow:
    """Part 3: TTFT of requests arriving at a steady rate."""

    mode: str
    rate: float
    ttft_ms: list[float]
    wall_s: float

    def percentile(self, q: float) -> float:
        """The ``q`` quantile of the TTFTs (nearest rank)."""
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def load_engine(model: str | None) -> KVBoost:
    """The engine over the embedded model, a local folder, or (``"tiny"``) a random tiny llama."""
    if model == "tiny":
        from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

        return KVBoost.from_model(tiny_model("llama"), tiny_tokenizer(), show_progress=False, chunk_size=32)
    return KVBoost.from_pretrained(model, show_progress=False)


def decode_steps(engine: KVBoost, prompts: Sequence[str], sizes: Sequence[int], repeats: int = 3) -> list[StepRow]:
    """Median time of one decode step (the engine loop's packed pass of one token per row,
    ``ModelAdapter.forward_segments``) over ``size`` prompts prefilled in full, for each size."""
    from kvboost_rag.hf import ModelAdapter
    from kvboost_rag.hf.packed import Segment

    adapter = ModelAdapter(engine.model, engine.tokenizer)
    rows_needed = max(sizes)
    caches, positions = [], []
    for prompt in prompts[:rows_needed]:
        ids = engine.tokenizer(prompt)["input_ids"]
        cache = adapter.new_cache(len(ids) + repeats * len(sizes) + 1)
        adapter.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        caches.append(cache)
        positions.append(len(ids))
    token = torch.tensor([engine.tokenizer.eos_token_id or 0])
    rows = []
    for size in sizes:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            adapter.forward_segments(
                [Segment(token, torch.tensor([position]), cache, logits=1, decode=True) for position, cache in zip(positions, caches[:size])]
            )
            times.append((time.perf_counter() - start) * 1000)
            positions[:size] = [p + 1 for p in positions[:size]]
        rows.append(StepRow(size, statistics.median(times)))
    return rows


def batch_vs_sequential(engine: KVBoost, prompts: Sequence[str], new_tokens: int) -> BatchRow:
    """Time ``generate`` over the prompts one by one, then one ``generate_batch`` call."""
    start = time.perf_counter()
    alone = [engine.generate(p, max_new_tokens=new_tokens) for p in prompts]
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    batched = engine.generate_batch(prompts, max_new_tokens=new_tokens)
    batch_s = time.perf_counter() - start
    for result in batched:
        if isinstance(result, Exception):
            raise result
    identical = sum(a.token_ids == b.token_ids for a, b in zip(alone, batched))
    return BatchRow(len(prompts), new_tokens, sequential_s, batch_s, identical)


# ---------------------------------------------------------------------- throughput runners
def engine_runner(engine: KVBoost, new_tokens: int) -> Callable[[Sequence[str], int], int]:
    """``c`` threads calling ``engine.generate`` until the prompts are done."""

    def run(prompts: Sequence[str], concurrency: int) -> int:
        with ThreadPoolExecutor(concurrency) as pool:
            return sum(pool.map(lambda p: engine.generate(p, max_new_tokens=new_tokens).generated_tokens, prompts))

    return run


def langchain_runner(engine: KVBoost, new_tokens: int) -> Callable[[Sequence[str], int], int]:
    """LangChain ``KVBoostLLM.batch`` with ``max_concurrency=c`` (chunks of ``c`` prompts)."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_kvboost import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_new_tokens=new_tokens)

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.count = 0

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            self.count += sum(int(g[0].generation_info["generated_tokens"]) for g in response.generations)

    def run(prompts: Sequence[str], concurrency: int) -> int:
        counter = Tokens()
        llm.batch(list(prompts), config={"max_concurrency": concurrency, "callbacks": [counter]})
        return counter.count

    return run


def llama_index_runner(engine: KVBoost, new_tokens: int) -> Callable[[Sequence[str], int], int]:
    """LlamaIndex ``KVBoostLLM.acomplete``, at most ``c`` calls in flight."""
    from llama_index.llms.kvboost import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_new_tokens=new_tokens, set_global_tokenizer=False)

    async def run_all(prompts: Sequence[str], concurrency: int) -> int:
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: str) -> int:
            async with gate:
                response = await llm.acomplete(prompt, formatted=True)
            return int(response.raw["usage"]["completion_tokens"])

        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    return lambda prompts, concurrency: asyncio.run(run_all(prompts, concurrency))


def pipeline_runner(engine: KVBoost, new_tokens: int) -> Callable[[Sequence[str], int], int]:
    """LangChain ``HuggingFacePipeline`` with ``batch_size=c`` over the same model (full
    prefill, left-padded batches); tokens counted by tokenizing each output."""
    from langchain_huggingface import HuggingFacePipeline
    from transformers import AutoTokenizer, pipeline

    tokenizer = engine.tokenizer
    if engine.model.config.name_or_path and Path(engine.model.config.name_or_path).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(engine.model.config.name_or_path)
    else:  # the tiny tokenizer: a copy, so the engine's padding side stays as it is
        tokenizer = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, **tokenizer.special_tokens_map)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pipe = pipeline(
        "text-generation", model=engine.model, tokenizer=tokenizer, max_new_tokens=new_tokens, do_sample=False,
        return_full_text=False, pad_token_id=tokenizer.pad_token_id,
    )

    def run(prompts: Sequence[str], concurrency: int) -> int:
        llm = HuggingFacePipeline(pipeline=pipe, batch_size=concurrency)
        result = llm.generate(list(prompts))
        return sum(len(engine.token_ids(g[0].text)) for g in result.generations)

    return run


def throughput(
    name: str, run: Callable[[Sequence[str], int], int], prompts: Sequence[str], levels: Sequence[int]
) -> list[ThroughputRow]:
    """Run every prompt at each concurrency level; one row per level."""
    rows = []
    for concurrency in levels:
        start = time.perf_counter()
        tokens = run(prompts, concurrency)
        rows.append(ThroughputRow(name, concurrency, len(prompts), tokens, time.perf_counter() - start))
        logger.info("%s c=%d: %.1f tokens/s", name, concurrency, rows[-1].tokens_per_s)
    return rows


# ---------------------------------------------------------------------- TTFT under load
def ttft_under_load(engine: KVBoost, prompts: Sequence[str], rate: float, new_tokens: int, mode: str) -> LoadRow:
    """Start one request every ``1 / rate`` seconds (each in its own thread); their TTFTs."""
    ttfts: list[float] = []
    lock = threading.Lock()

    def call(prompt: str) -> None:
        result = engine.generate(prompt, max_new_tokens=new_tokens)
        with lock:
            ttfts.append(result.ttft_ms)

    threads = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=call, args=(prompt,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return LoadRow(mode, rate, ttfts, time.perf_counter() - start)


# ---------------------------------------------------------------------- output
def print_tables(
    steps: list[StepRow], batch: BatchRow, rows: list[ThroughputRow], load: list[LoadRow], header: str
) -> None:
    """Markdown tables of every part."""
    print(f"\n{header}\n")
    print("| sequences per decode step | step ms (median) | ms per sequence |")
    print("|---:|---:|---:|")
    for step in steps:
        print(f"| {step.batch} | {step.step_ms:.0f} | {step.ms_per_token:.1f} |")
    print()
    print("| prompts x new tokens | sequential s | batch s | batch / sequential | identical greedy outputs |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| {batch.prompts} x {batch.new_tokens} | {batch.sequential_s:.2f} | {batch.batch_s:.2f} | "
        f"{batch.ratio:.2f}x | {batch.identical}/{batch.prompts} |"
    )
    levels = sorted({r.concurrency for r in rows})
    systems = list(dict.fromkeys(r.system for r in rows))
    print("\n| system | " + " | ".join(f"c={c} tok/s" for c in levels) + " |")
    print("|---|" + "---:|" * len(levels))
    for system in systems:
        by_level = {r.concurrency: r for r in rows if r.system == system}
        print(f"| {system} | " + " | ".join(f"{by_level[c].tokens_per_s:.1f}" for c in levels) + " |")
    print("\n| mode | arrivals/s | requests | TTFT p50 ms | TTFT p95 ms | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in load:
        print(
            f"| {row.mode} | {row.rate:g} | {len(row.ttft_ms)} | {row.percentile(0.5):.0f} | "
            f"{row.percentile(0.95):.0f} | {row.wall_s:.1f} |"
        )


def plot(rows: list[ThroughputRow], load: list[LoadRow], path: Path) -> None:
    """Throughput against concurrency (one line per system) and TTFT percentiles under load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in dict.fromkeys(r.system for r in rows):
        points = sorted((r.concurrency, r.tokens_per_s) for r in rows if r.system == system)
        left.plot([c for c, _ in points], [t for _, t in points], marker="o", label=system)
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency (requests in flight / batch size)")
    left.set_ylabel("generated tokens / s")
    left.set_title("Throughput")
    left.legend(fontsize=8)
    names = [row.mode for row in load]
    x = range(len(load))
    right.bar([i - 0.2 for i in x], [row.percentile(0.5) for row in load], width=0.4, label="p50")
    right.bar([i + 0.2 for i in x], [row.percentile(0.95) for row in load], width=0.4, label="p95")
    right.set_xticks(list(x), names)
    right.set_ylabel("TTFT ms")
    right.set_title(f"TTFT at {load[0].rate:g} arrivals/s" if load else "TTFT")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> tuple[list[StepRow], BatchRow, list[ThroughputRow], list[LoadRow]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local model folder, 'tiny', or the embedded model")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of part 1")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt of part 1")
    parser.add_argument("--docs", type=int, default=3, help="documents per prompt")
    parser.add_argument("--doc-chars", type=int, default=600, help="characters per document (at most)")
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level of part 2")
    parser.add_argument("--load-new-tokens", type=int, default=16, help="new tokens per request of parts 2 and 3")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="concurrency levels of part 2")
    parser.add_argument("--systems", default="engine,langchain,llama_index,pipeline", help="systems of part 2")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second of part 3")
    parser.add_argument("--arrivals", type=int, default=12, help="requests of part 3")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for the plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = load_engine(args.model)
    count = max(args.prompts, args.requests, args.arrivals)
    built, pool = build_prompts(count, args.docs, args.doc_chars, args.seed)
    prompts = [prompt for prompt, _, _ in built]
    engine.warm(SYSTEM_PROMPT + "\n\n")
    engine.warm_documents(pool)
    for prompt in prompts:  # untimed: what each prompt teaches the cache is stored before timing
        engine.generate(prompt, max_new_tokens=2)
    tokens = [len(engine.tokenizer(p)["input_ids"]) for p in prompts]

    levels = [int(c) for c in args.concurrency.split(",")]
    steps = decode_steps(engine, prompts, sorted({1, *levels}))
    batch = batch_vs_sequential(engine, prompts[: args.prompts], args.new_tokens)

    runners = {
        "engine": engine_runner,
        "langchain": langchain_runner,
        "llama_index": llama_index_runner,
        "pipeline": pipeline_runner,
    }
    labels = {
        "engine": "engine (threads)",
        "langchain": "LangChain KVBoostLLM.batch",
        "llama_index": "LlamaIndex KVBoostLLM.acomplete",
        "pipeline": "HuggingFacePipeline batch_size",
    }
    rows: list[ThroughputRow] = []
    for system in args.systems.split(","):
        run = runners[system](engine, args.load_new_tokens)
        rows += throughput(labels[system], run, prompts[: args.requests], levels)

    arrivals = prompts[: args.arrivals]
    load = [ttft_under_load(engine, arrivals, args.rate, args.load_new_tokens, "continuous batching")]
    batch_size = engine.settings.max_batch_size
    engine.settings.max_batch_size = 1
    try:
        load.append(ttft_under_load(engine, arrivals, args.rate, args.load_new_tokens, "one at a time"))
    finally:
        engine.settings.max_batch_size = batch_size

    header = (
        f"model={engine.model_name} device={engine.model.device} threads={torch.get_num_threads()} "
        f"prompt_tokens median {int(statistics.median(tokens))} (min {min(tokens)}, max {max(tokens)}), "
        f"docs/prompt={args.docs}, doc_chars<={args.doc_chars}, documents prewarmed, "
        f"part 2/3: {args.load_new_tokens} new tokens per request, {args.requests} requests per level"
    )
    print_tables(steps, batch, rows, load, header)
    if args.out is not None:
        plot(rows, load, args.out / "batch_throughput.png")
    return steps, batch, rows, load


if __name__ == "__main__":
    main()
