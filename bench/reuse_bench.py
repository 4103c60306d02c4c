"""Reuse benchmark: TTFT and quality of each repair strategy against full prefill.

Embedded model (or ``--model PATH``). Each prompt asks one question of ``bench/qa.json``
over the document that answers it plus distractors, all in shuffled order: plain completion
prompts, or (``--chat``) the model's chat template with the instructions in the system turn
and the documents plus the question in the user turn. Where the documents' K/V comes from
(``--documents-from``):

- ``warm`` (default): prewarmed (``warm_documents``) behind the system prompt and
  ``warm_context_documents`` other documents, once, before any prompt.
- ``named``: nothing warmed. Before each row of each prompt the cache is cleared and a "first
  sight" prompt is generated, untimed: the same documents in the reverse order (so no
  document stands where it will) with another question, ``documents=[their texts]``; then
  the measured prompt is generated with ``documents=`` too.
- ``blocks``: as ``named``, but both prompts are plain (no ``documents=``, no warm): the
  measured prompt finds its documents only because the first sight's blocks (its pieces set
  off by blank or separator lines, ``store_prompt_blocks``) were stored. Python's reference
  documents hold blank lines and ``****`` lines, so each is stored as several blocks (its
  paragraphs); what is no block (separator and heading lines, pieces too short, closing
  punctuation) is computed live.

In ``named`` and ``blocks`` modes the rows are ``none`` and ``default`` (the engine's default
repair) unless ``--methods``/``--ratios``/``--rows`` name others (each row gets its own first
sight, so any row works, at the cost of one more generate). Every run also prints, per row,
the share of the documents' tokens (each tokenized alone) that were read from cache by
content (``content_hit_tokens``), so a run shows the documents really were found.

Every method is timed the same way (wall time from the call to the first
token) in the same run and compared with full prefill of the same prompt: first-token KL,
top-1 agreement, greedy 32-token agreement (share of the output before the first difference,
and the share of outputs identical), QA exact match, and how many prompts came out worse
than no repair at all.

Each TTFT is also measured as the CPU time the process spent from the call to its first text
piece (every thread: the engine loop runs the prefill): with ``--threads 1`` it is the work
done, not the wall time other processes on a shared machine add, and ``CPU-time speedup`` is
the ratio of those. Per-stage times (lookup, stitch, probe, select, blend) are printed in a second
table. ``--corpus stdlib|packages`` uses other real text than Python's reference topics
(``bench/corpora.py``); ``--out PATH`` writes the tables and every measurement
(``bench/frontier.py`` plots them).

Run: ``python bench/reuse_bench.py --threads 2`` (``--quick`` for fewer prompts; ``--chat``;
``--docs 16 --doc-chars 3000`` for long prompts; ``--ratios`` for more CacheBlend rows;
``--context-documents 0`` for documents warmed behind the system prompt alone;
``--documents-from named|blocks``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import CORPORA, extractive_questions, load_corpus
from rag_bench import QAItem, cut_documents, exact_match, load_qa, usable_items

from kvboost_rag import GenerationResult, KVBoost
from kvboost_rag.diagnosis.correctness import first_token_kl
from kvboost_rag.diagnosis.stage_times import record_stages

SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below. Quote the relevant rule, keep the answer short, and say so "
    "when the documents do not contain the answer."
)
#: Prefill stages timed apart (kvboost_rag.diagnosis.stage_times), in order; ``other`` is the rest of
#: the TTFT (tokenizing, planning, the first token's choice).
STAGES = ("lookup", "stitch", "probe", "select", "blend")
#: (row name, settings): every repair measured, with no repair, the engine's default repair
#: (``default``: no setting changed) and EPIC's LegoLink (recompute the first 16 tokens of each
#: reused document) as named baselines.
METHODS: list[tuple[str, dict]] = [
    ("none", {"recompute_strategy": "none", "recompute_ratio": 0.0, "keep_document_start": 0}),
    ("default", {}),  # the engine's default repair, whatever its settings are
    ("legolink 16", {"recompute_strategy": "none", "recompute_ratio": 0.0, "keep_document_start": 16}),
    ("selective 15%", {"recompute_strategy": "selective", "recompute_ratio": 0.15, "keep_document_start": 0}),
    ("attention 5%", {"recompute_strategy": "attention", "recompute_ratio": 0.05, "keep_document_start": 0}),
    ("attention 15%", {"recompute_strategy": "attention", "recompute_ratio": 0.15, "keep_document_start": 0}),
    ("attention auto", {"recompute_strategy": "attention", "recompute_ratio": "auto", "keep_document_start": 0}),
    ("cacheblend 5%", {"recompute_strategy": "cacheblend", "recompute_ratio": 0.05, "keep_document_start": 0}),
    ("cacheblend 15%", {"recompute_strategy": "cacheblend", "recompute_ratio": 0.15, "keep_document_start": 0}),
    ("cacheblend 30%", {"recompute_strategy": "cacheblend", "recompute_ratio": 0.30, "keep_document_start": 0}),
    ("cacheblend auto", {"recompute_strategy": "cacheblend", "recompute_ratio": "auto", "keep_document_start": 0}),
    (
        "cacheblend 15%, 2 stages",
        {"recompute_strategy": "cacheblend", "recompute_ratio": 0.15, "keep_document_start": 0, "blend_stages": 2},
    ),
]
#: Where the documents' K/V comes from (see the module docstring).
DOCUMENT_SOURCES = ("warm", "named", "blocks")
#: Rows run by default when the documents are found after a first sight (named or blocks).
FIRST_SIGHT_ROWS = ("none", "default")


def corpus_items(corpus: str, doc_chars: int, count: int, seed: int) -> tuple[dict[str, str], list[QAItem]]:
    """Documents (name -> text cut to ``doc_chars``) and QA items of ``corpus``.

    ``reference``: Python's reference topics with the questions of ``qa.json``; any corpus of
    :data:`corpora.CORPORA`: its documents with extractive questions (the words after a quoted
    phrase of one document).
    """
    if corpus == "reference":
        docs = cut_documents(doc_chars)
        return docs, usable_items(load_qa(), docs)
    docs = load_corpus(corpus, doc_chars)
    questions = extractive_questions(docs, count, random.Random(seed))
    return docs, [QAItem(name, question, (answer,)) for name, question, answer in questions]


def build_prompts(
    count: int,
    per_prompt: int,
    doc_chars: int,
    seed: int,
    render_chat=None,
    corpus: str = "reference",
) -> tuple[list[tuple[str, list[str], tuple[str, ...]]], list[str]]:
    """QA prompts: the answering document plus ``per_prompt - 1`` distractors, shuffled.

    Args:
        render_chat: ``messages -> prompt`` for chat-template prompts; ``None`` for plain ones.
        corpus: ``reference`` (the default) or a corpus of :data:`corpora.CORPORA`.

    Returns:
        ``(prompt, documents, answers)`` triples and the document pool to prewarm.
    """
    rng = random.Random(seed)
    docs, items = corpus_items(corpus, doc_chars, count, seed)
    # Distractors that fill the cut, so the prompt length follows --docs x --doc-chars.
    long_docs = sorted(d for d in set(docs.values()) if len(d) >= 0.8 * doc_chars)
    pool = long_docs if len(long_docs) >= per_prompt else sorted(set(docs.values()))
    prompts = []
    for i in range(count):
        item = items[i % len(items)]
        answer_doc = docs[item.topic]
        chosen = [answer_doc, *rng.sample([d for d in pool if d != answer_doc], per_prompt - 1)]
        rng.shuffle(chosen)
        prompts.append((prompt_text(chosen, item.question, render_chat), chosen, item.answers))
    used = sorted({d for _, chosen, _ in prompts for d in chosen})
    return prompts, used


def prompt_text(documents: list[str], question: str, render_chat=None) -> str:
    """The bench's prompt over ``documents`` (joined by blank lines) asking ``question``: plain,
    or rendered by ``render_chat`` (instructions in the system turn)."""
    context = "\n\n".join(documents)
    if render_chat is None:
        return f"{SYSTEM_PROMPT}\n\n{context}\n\nQuestion: {question}\nAnswer:"
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{context}\n\nQuestion: {question}"},
    ]
    return render_chat(messages)


def first_sight_prompts(
    prompts: list[tuple[str, list[str], tuple[str, ...]]],
    doc_chars: int,
    seed: int,
    render_chat=None,
    corpus: str = "reference",
) -> list[str]:
    """For each of :func:`build_prompts`' prompts, the prompt that shows its documents first:
    the same documents in the reverse order (no document where it stands in the measured
    prompt, the first one least of all) asking the next QA item's question."""
    _, items = corpus_items(corpus, doc_chars, len(prompts), seed)
    firsts = []
    for i, (_, chosen, _) in enumerate(prompts):
        question = items[(i + 1) % len(items)].question
        if question == items[i % len(items)].question:
            question = "Which rules do these documents state?"
        firsts.append(prompt_text(list(reversed(chosen)), question, render_chat))
    return firsts


def frontier_rows(ratios: str, stages: int, strategy: str = "cacheblend") -> list[tuple[str, dict]]:
    """Rows of ``strategy`` at each of the comma-separated ``ratios`` with ``stages`` blend stages."""
    rows = []
    for text in ratios.split(","):
        ratio = float(text)
        if not 0.0 <= ratio <= 1.0:
            raise SystemExit(f"--ratios: {ratio} is not between 0 and 1")
        name = f"{strategy} {ratio:.0%}" + (f", {stages} stages" if stages > 1 else "")
        settings = {"recompute_strategy": strategy, "recompute_ratio": ratio, "keep_document_start": 0}
        if stages > 1:
            settings["blend_stages"] = stages
        rows.append((name, settings))
    return rows


def apply_settings(settings, values: dict) -> None:
    """Set ``values`` on the engine's validated settings in an order every step of which is
    valid: ``recompute_ratio="auto"`` needs the attention or CacheBlend strategy, so the strategy changes first when the
    ratio becomes ``"auto"`` and last otherwise."""
    first = "recompute_strategy" if values.get("recompute_ratio") == "auto" else "recompute_ratio"
    for key in sorted(values, key=lambda key: key != first):
        setattr(settings, key, values[key])


def agreement(a: list[int], b: list[int]) -> float:
    """Share of positions where two greedy outputs agree, up to the first difference."""
    n = max(len(a), len(b), 1)
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / n


def make_parser() -> argparse.ArgumentParser:
    """The bench's options (the rows' in :func:`add_row_options`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--docs", type=int, default=6, help="documents per prompt")
    parser.add_argument("--doc-chars", type=int, default=1500, help="characters per document (at most)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="3 prompts, 16 new tokens")
    parser.add_argument("--chat", action="store_true", help="chat-template prompts (documents in the user turn)")
    parser.add_argument("--check-layer", type=int, default=None, help="override settings.check_layer")
    parser.add_argument(
        "--context-documents", type=int, default=None, help="override settings.warm_context_documents"
    )
    parser.add_argument(
        "--documents-from",
        default="warm",
        choices=DOCUMENT_SOURCES,
        help="warm: prewarm the documents (default); named: no warm, each row after a first sight of "
        "the documents in another order with documents=[...], measured with documents= too; blocks: "
        "the same with plain prompts, found only as the first sight's stored blocks. named and blocks "
        f"run the rows {' and '.join(FIRST_SIGHT_ROWS)} (the engine's default repair) unless "
        "--methods/--ratios/--rows name others",
    )
    add_row_options(parser)
    parser.add_argument(
        "--corpus",
        default="reference",
        choices=["reference", *CORPORA],
        help="documents: Python's reference topics (default), stdlib docstrings or installed packages' descriptions",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the tables (.md) and rows (.json) here")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def add_row_options(parser: argparse.ArgumentParser) -> None:
    """The options that choose the rows."""
    parser.add_argument(
        "--methods",
        default=None,
        help="row names to run, separated by ';' (or ',' when no name has a comma); default: all "
        "(with --documents-from named|blocks: none and default)",
    )
    parser.add_argument(
        "--ratios",
        default=None,
        help="comma-separated ratios to add as rows (e.g. 0.05,0.1,0.2) to trace a frontier",
    )
    parser.add_argument(
        "--ratio-strategies",
        default="cacheblend",
        help="comma-separated strategies of the rows --ratios adds (default cacheblend)",
    )
    parser.add_argument(
        "--stages", type=int, default=1, help="blend_stages of the rows --ratios adds (default 1)"
    )
    parser.add_argument(
        "--rows",
        default=None,
        help='extra rows as JSON, [["name", {setting: value, ...}], ...] (any KVBoostSettings field)',
    )


def select_methods(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[str, dict]]:
    """The rows ``--methods``, ``--ratios`` and ``--rows`` name (see :func:`add_row_options`)."""
    methods = METHODS
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(";" if ";" in args.methods else ",")]
        unknown = sorted(set(wanted) - {name for name, _ in METHODS})
        if unknown:
            parser.error(f"unknown method(s) {unknown}; choose from {[name for name, _ in METHODS]}")
        methods = [m for m in METHODS if m[0] in wanted]
    elif args.documents_from != "warm":
        methods = [] if args.ratios or args.rows else [m for m in METHODS if m[0] in FIRST_SIGHT_ROWS]
    if args.ratios:
        named = {name for name, _ in methods}
        added = [row for strategy in args.ratio_strategies.split(",") for row in frontier_rows(args.ratios, args.stages, strategy.strip())]
        methods = [*methods, *(row for row in added if row[0] not in named)]
    if args.rows:
        named = {name for name, _ in methods}
        methods = [*methods, *((name, dict(values)) for name, values in json.loads(args.rows) if name not in named)]
    return methods


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.prompts, args.new_tokens = 3, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = select_methods(args, parser)
    settings = {"show_progress": False}
    if args.check_layer is not None:
        settings["check_layer"] = args.check_layer
    if args.context_documents is not None:
        settings["warm_context_documents"] = args.context_documents
    engine = KVBoost.from_pretrained(args.model, **settings)
    render = engine.apply_chat_template if args.chat else None
    prompts, pool = build_prompts(args.prompts, args.docs, args.doc_chars, args.seed, render, args.corpus)
    firsts: list[str | None] = [None] * len(prompts)
    if args.documents_from != "warm":
        firsts = list(first_sight_prompts(prompts, args.doc_chars, args.seed, render, args.corpus))
    warm_s = prepare(engine, args, prompts[0], firsts[0], pool)

    run = Run(methods, {key: getattr(engine.settings, key) for _, method in methods for key in method})
    loads = [os.getloadavg()[0]]
    for entry, first in zip(prompts, firsts):
        measure_prompt(engine, args, run, entry, first)
        loads.append(os.getloadavg()[0])
    report(engine, args, run, loads, warm_s, len(pool), argv)


def prepare(
    engine: KVBoost, args: argparse.Namespace, entry: tuple[str, list[str], tuple[str, ...]], first: str | None, pool: list[str]
) -> float:
    """Warm the beginning and the documents (``--documents-from warm``; seconds it took) and
    take first-call overheads out of the timings (with a first sight: of the first prompt's
    first sight and then of the prompt itself, so the repair has run once too)."""
    warm_s = 0.0
    if args.documents_from == "warm":
        if args.chat:
            beginning = engine.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}], add_generation_prompt=False)
        else:
            beginning = SYSTEM_PROMPT + "\n\n"
        start = time.perf_counter()
        engine.warm(beginning)  # documents are warmed behind the latest warmed beginning
        engine.warm_documents(pool)
        warm_s = time.perf_counter() - start
    named = {"documents": list(entry[1])} if args.documents_from == "named" else {}
    if first is not None:
        engine.generate(first, max_new_tokens=2, **named)
    engine.generate(entry[0], max_new_tokens=2, **named)  # first-call overheads out of the timings
    return warm_s


class Run:
    """The rows being measured and every value recorded per row."""

    def __init__(self, methods: list[tuple[str, dict]], defaults: dict[str, Any]) -> None:
        self.methods = methods
        #: Each row sets what it names; everything else stays at the engine's settings.
        self.defaults = defaults
        self.rows: dict[str, dict[str, list[float]]] = {}
        self.worse_than_none: dict[str, int] = {}
        self.prompt_tokens: list[int] = []

    def record(self, name: str, **values: float) -> None:
        for key, value in values.items():
            self.rows.setdefault(name, {}).setdefault(key, []).append(value)


def measure_prompt(
    engine: KVBoost, args: argparse.Namespace, run: Run, entry: tuple[str, list[str], tuple[str, ...]], first: str | None
) -> None:
    """Full prefill of one prompt, then each row against it (after the row's own first sight
    of the documents when ``first`` is given)."""
    prompt, documents, answers = entry
    with record_stages() as stages:
        full, full_cpu = generate_with_cpu(engine, prompt, max_new_tokens=args.new_tokens, reuse=False, return_logits=True)
    run.prompt_tokens.append(full.prompt_tokens)
    run.record(
        "full prefill", ttft=full.ttft_ms, speedup=1.0, cpu=full_cpu, cpu_speedup=1.0, reuse=0.0, kl=0.0, top1=1.0, greedy=1.0, identical=1.0,
        first_diff=float(len(full.token_ids)), exact=float(exact_match(full.output_text, answers)), ratio=0.0,
        total=full.total_ms, doc_hit=0.0, found=0.0, **stage_values(stages, full.ttft_ms),
    )
    doc_tokens = sum(len(engine.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in documents)
    named = {"documents": list(documents)} if args.documents_from == "named" else {}
    none_kl = None
    for name, method in run.methods:
        apply_settings(engine.settings, {**run.defaults, **method})
        if first is not None:
            engine.clear_cache()  # the row finds only what the first sight stored
            engine.generate(first, max_new_tokens=2, **named)
        with record_stages() as stages:
            res, cpu = generate_with_cpu(engine, prompt, max_new_tokens=args.new_tokens, return_logits=True, **named)
        values = row_values(full, full_cpu, res, cpu, answers, stages)
        if name == "none":
            none_kl = values["kl"]
        elif none_kl is not None and values["kl"] > none_kl:
            run.worse_than_none[name] = run.worse_than_none.get(name, 0) + 1
        run.record(name, doc_hit=res.content_hit_tokens / max(doc_tokens, 1), found=float(res.documents_found), **values)


def row_values(
    full: GenerationResult, full_cpu: float, res: GenerationResult, cpu: float, answers: tuple[str, ...], stages: dict[str, float]
) -> dict[str, float]:
    """What one row's call measured against full prefill of the same prompt."""
    return dict(
        ttft=res.ttft_ms,
        speedup=full.ttft_ms / res.ttft_ms,
        cpu=cpu,
        cpu_speedup=full_cpu / cpu,
        reuse=(res.prefix_hit_tokens + res.content_hit_tokens) / res.prompt_tokens,
        kl=first_token_kl(full.first_token_logits, res.first_token_logits),
        top1=float(full.first_token_logits.argmax() == res.first_token_logits.argmax()),
        greedy=agreement(full.token_ids, res.token_ids),
        identical=float(full.token_ids == res.token_ids),
        first_diff=float(first_difference(full.token_ids, res.token_ids)),
        exact=float(exact_match(res.output_text, answers)),
        ratio=res.recomputed_tokens / max(res.content_hit_tokens, 1),
        total=res.total_ms,
        **stage_values(stages, res.ttft_ms),
    )


def report(engine: KVBoost, args: argparse.Namespace, run: Run, loads: list[float], warm_s: float, pool: int, argv: list[str] | None) -> None:
    """Print the tables (and write them with every measurement to ``--out``)."""
    tokens = run.prompt_tokens
    header = (
        f"model={engine.model_name} device={engine.model.device} threads={torch.get_num_threads()} "
        f"corpus={args.corpus} prompts={args.prompts} prompt_tokens(median)={int(statistics.median(tokens))} "
        f"(min {min(tokens)}, max {max(tokens)}) docs/prompt={args.docs} "
        f"doc_chars<={args.doc_chars} chat={args.chat} documents_from={args.documents_from} "
        f"check_layer={engine.settings.check_layer} "
        + (
            f"context_documents={engine.settings.warm_context_documents} warm={warm_s:.1f}s ({pool} docs) "
            if args.documents_from == "warm"
            else "no warm: each row after an untimed first sight (cache cleared) "
        )
        + f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}"
    )
    lines = [
        header, "", *quality_table(run.rows, run.worse_than_none), "", *document_table(run.rows, args.documents_from),
        "", *stage_table(run.rows),
    ]
    print("\n" + "\n".join(lines))
    if args.out is not None:
        command = "python bench/reuse_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.out.with_suffix(".md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
        payload = {"command": command, "header": header, "documents_from": args.documents_from, "loads": loads, "rows": run.rows}
        args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1))


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first greedy token where two outputs differ (their length when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else len(a)


def generate_with_cpu(engine: KVBoost, prompt: str, **options: Any) -> tuple[GenerationResult, float]:
    """``engine.generate(prompt, **options)`` as a stream, and the CPU time (ms) the process
    spent from the call to the first text piece."""
    cpu_start = time.process_time()
    stream = engine.stream(prompt, **options)
    first_cpu = None
    for _ in stream:
        if first_cpu is None:
            first_cpu = (time.process_time() - cpu_start) * 1000
    assert stream.result is not None
    return stream.result, first_cpu if first_cpu is not None else (time.process_time() - cpu_start) * 1000


def stage_values(stages: dict[str, float], ttft_ms: float) -> dict[str, float]:
    """Milliseconds per prefill stage of one call, ``other`` the rest of its TTFT."""
    values = {stage: stages.get(stage, 0.0) for stage in STAGES}
    values["other"] = ttft_ms - sum(values.values())
    return values


def quality_table(rows: dict[str, dict[str, list[float]]], worse_than_none: dict[str, int]) -> list[str]:
    """Markdown: TTFT, speedup and quality of each row."""
    base = statistics.median(rows["full prefill"]["ttft"])
    lines = [
        "| method | median TTFT ms | speedup (medians) | speedup (median per prompt) | CPU-time speedup | loaded | "
        "recomputed | mean KL | median KL | top-1 | greedy agree | identical | first difference (median) | "
        "exact match | KL > none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, vals in rows.items():
        ttft = statistics.median(vals["ttft"])
        lines.append(
            f"| {name} | {ttft:.0f} | {base / ttft:.2f}x | {statistics.median(vals['speedup']):.2f}x | "
            f"{statistics.median(vals['cpu_speedup']):.2f}x | "
            f"{statistics.mean(vals['reuse']):.2f} | {statistics.mean(vals['ratio']):.2f} | "
            f"{statistics.mean(vals['kl']):.4f} | {statistics.median(vals['kl']):.4f} | "
            f"{statistics.mean(vals['top1']):.2f} | {statistics.mean(vals['greedy']):.2f} | "
            f"{statistics.mean(vals['identical']):.2f} ({sum(vals['identical']):.0f}/{len(vals['identical'])}) | "
            f"{statistics.median(vals['first_diff']):.0f} | {statistics.mean(vals['exact']):.2f} | "
            f"{worse_than_none.get(name, 0) if name != 'full prefill' else '-'} |"
        )
    return lines


def document_table(rows: dict[str, dict[str, list[float]]], source: str) -> list[str]:
    """Markdown: per row, the share of the documents' tokens (each tokenized alone) read from
    cache by content, and the document occurrences found (blocks count one each)."""
    lines = [
        f"Documents from: {source}. Document tokens from cache = content_hit_tokens / the prompt's documents' tokens.",
        "",
        "| method | document tokens from cache (mean) | min | max | documents found (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, vals in rows.items():
        if name == "full prefill":
            continue
        hit = vals["doc_hit"]
        lines.append(
            f"| {name} | {statistics.mean(hit):.2f} | {min(hit):.2f} | {max(hit):.2f} | {statistics.median(vals['found']):.0f} |"
        )
    return lines


def stage_table(rows: dict[str, dict[str, list[float]]]) -> list[str]:
    """Markdown: median milliseconds of each prefill stage per row, then TTFT and the whole
    call (decoding and any work after the first token included)."""
    names = (*STAGES, "other")
    lines = [
        "| method | " + " | ".join(f"{n} ms" for n in names) + " | TTFT ms | total ms |",
        "|---|" + "---:|" * (len(names) + 2),
    ]
    for name, vals in rows.items():
        cells = " | ".join(f"{statistics.median(vals[n]):.0f}" for n in names)
        total = statistics.median(vals["total"]) if "total" in vals else float("nan")
        lines.append(f"| {name} | {cells} | {statistics.median(vals['ttft']):.0f} | {total:.0f} |")
    return lines

if __name__ == "__main__":
    main()
