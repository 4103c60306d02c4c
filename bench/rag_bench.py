"""Side-by-side RAG benchmark: time to first token and answer quality of every system.

One command runs the same model on the same prompts through:

- full prefill with plain transformers ``model.generate`` (HuggingFacePipeline/HuggingFaceLLM);
- prefix-only caching (longest cached token prefix, like vLLM APC / SGLang radix cache);
- the PyPI ``kvboost`` package through its own API, when installed;
- kvboost-rag with no repair, selective, CacheBlend and attention repair at several recompute ratios;
- kvboost-rag through ``langchain_kvboost`` and ``llama_index.llms.kvboost``.

Workloads: RAG prompts (system prompt + k shuffled Python reference documents + a question
whose answer is in one of them, see ``bench/qa.json``), every question of ``qa.json`` in a
short prompt (exact-match accuracy), and a multi-turn chat whose history grows. TTFT is wall
time from the call to the first generated token, everything included. Quality is measured
against full prefill: first-token KL, top-1 agreement, greedy-output agreement, plus
exact-match answers. Writes ``results.md``, ``results.json`` and PNG plots
to ``--out``.

Run: ``python bench/rag_bench.py --quick`` (a few minutes on 2 cores) or without ``--quick``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plots  # noqa: E402
from llamacpp_system import LlamaCppSystem  # noqa: E402
from rag_systems import (  # noqa: E402
    Completion,
    EngineWarmer,
    KVBoostRagSystem,
    LangChainSystem,
    LlamaIndexSystem,
    PrefixCacheGenerate,
    PyPIKVBoost,
    System,
    TransformersGenerate,
)

from kvboost_rag import KVBoost  # noqa: E402
from kvboost_rag.corpus import python_reference_topics  # noqa: E402
from kvboost_rag.diagnosis.correctness import first_token_kl  # noqa: E402

logger = logging.getLogger("rag_bench")

BENCH_DIR = Path(__file__).resolve().parent
QA_PATH = BENCH_DIR / "qa.json"
REFERENCE = "transformers generate (full prefill)"
SYSTEM_PROMPT = (
    "You answer questions about Python from the given documents. Reply with just the answer: "
    "one term copied from the documents."
)
SENTINEL = "@@USER-CONTENT@@"


# ---------------------------------------------------------------------------- configuration
@dataclass
class BenchConfig:
    """What one benchmark run does.

    Attributes:
        questions: QA items used as RAG prompts (first ones of ``qa.json``).
        k_values: Documents per RAG prompt, cycled over the questions.
        doc_chars: Each document is cut to this many characters.
        pool: Documents in the corpus slice the prompts draw from (all are prewarmed).
        qa_questions: QA items asked in short prompts for exact-match accuracy (0 skips them).
        qa_k: Documents per QA prompt (the answer's document and distractors).
        qa_doc_chars: Characters per document in QA prompts.
        chat_turns: Turns of the multi-turn chat.
        chat_docs: Documents attached to each chat turn.
        new_tokens: Tokens generated per answer.
        ratios: Recompute ratios for the selective, CacheBlend and attention rows.
        adapter_ratio: Recompute ratio of the adapter rows (the default attention repair) and the
            PyPI kvboost row (its CacheBlend mode).
        seed: Seed of document sampling and shuffling.
        out: Output folder.
        llamacpp: Add llama.cpp rows (llama-cpp-python on the embedded GGUF, flash attention
            off and on); a missing llama-cpp-python is then an error naming the install.
        threads: CPU threads of every row (torch's, and llama.cpp's).
    """

    questions: int = 18
    k_values: tuple[int, ...] = (2, 4, 6, 8, 10)
    doc_chars: int = 3000
    pool: int = 32
    qa_questions: int = 18
    qa_k: int = 3
    qa_doc_chars: int = 1200
    chat_turns: int = 4
    chat_docs: int = 2
    new_tokens: int = 24
    ratios: tuple[float, ...] = (0.05, 0.10, 0.15, 0.30)
    adapter_ratio: float = 0.10
    seed: int = 0
    out: Path = BENCH_DIR / "results"
    llamacpp: bool = False
    threads: int = 1


QUICK = {
    "questions": 3,
    "k_values": (2, 3),
    "doc_chars": 1000,
    "pool": 6,
    "qa_questions": 4,
    "qa_k": 2,
    "chat_turns": 2,
    "chat_docs": 1,
}


@dataclass(frozen=True)
class QAItem:
    """A question whose answer is stated in one reference document."""

    topic: str
    question: str
    answers: tuple[str, ...]


@dataclass
class BenchPrompt:
    """One prompt every system answers."""

    workload: str
    index: int
    text: str
    documents: list[str]
    item: QAItem
    k: int
    tokens: int = 0


@dataclass
class Record:
    """One system's answer to one prompt, with its quality against the reference."""

    workload: str
    prompt: int
    system: str
    family: str
    strategy: str | None
    ratio: float | None
    prompt_tokens: int
    k: int
    ttft_ms: float
    reported_ttft_ms: float | None
    reuse: float
    speedup: float
    kl: float | None
    top1: float | None
    greedy: float
    exact: float
    text: str


@dataclass
class BenchResult:
    """Everything a run measured."""

    config: BenchConfig
    records: list[Record] = field(default_factory=list)
    warm_seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    machine: str = ""
    code: str = ""
    command: str = ""
    model: str = ""


# ---------------------------------------------------------------------------- data
def load_qa(path: Path = QA_PATH) -> list[QAItem]:
    """QA items of ``qa.json``."""
    data = json.loads(path.read_text())
    return [QAItem(i["topic"], i["question"], tuple(i["answers"])) for i in data["items"]]


def normalize(text: str) -> str:
    """Lower case, without quotes, emphasis marks and whitespace (for exact match)."""
    return "".join(text.lower().translate(str.maketrans("", "", "\"'`*“”’")).split())


def exact_match(output: str, answers: Sequence[str]) -> bool:
    """Whether one normalized expected answer appears in the normalized output."""
    out = normalize(output)
    return any(normalize(a) in out for a in answers)


def cut_documents(doc_chars: int) -> dict[str, str]:
    """Topic -> reference document cut to ``doc_chars`` (on a line break when one is near)."""
    out = {}
    for topic, doc in python_reference_topics().items():
        if len(doc) > doc_chars:
            end = doc.rfind("\n", 0, doc_chars)
            doc = doc[: end if end > doc_chars // 2 else doc_chars].rstrip()
        out[topic] = doc
    return out


def usable_items(items: Sequence[QAItem], docs: dict[str, str]) -> list[QAItem]:
    """Items whose answer survives the document cut (others are logged and dropped)."""
    kept = []
    for item in items:
        if any(normalize(a) in normalize(docs[item.topic]) for a in item.answers):
            kept.append(item)
        else:
            logger.info("dropping %r: its answer is cut off at this --doc-chars", item.question)
    return kept


def document_pool(items: Sequence[QAItem], docs: dict[str, str], size: int, rng: random.Random) -> list[str]:
    """Topics of the prompts: the answer topics plus random distractor topics up to ``size``.

    Distractors are drawn from the documents that fill the ``--doc-chars`` cut first, so k
    documents make a prompt of a predictable length.
    """
    topics = list(dict.fromkeys(item.topic for item in items))
    others = [t for t in docs if t not in topics]
    rng.shuffle(others)
    cut = max(len(d) for d in docs.values())
    others.sort(key=lambda t: len(docs[t]) < 0.8 * cut)  # stable: long documents first, random within
    return topics + others[: max(0, size - len(topics))]


# ---------------------------------------------------------------------------- prompts
def make_renderer(tokenizer: Any) -> Callable[[list[dict[str, str]]], str]:
    """Messages -> prompt text: the tokenizer's chat template, or plain role lines without one."""
    if getattr(tokenizer, "chat_template", None):
        return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def plain(messages: list[dict[str, str]]) -> str:
        turns = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
        return turns + "Assistant:"

    logger.info("the tokenizer has no chat template; prompts use plain 'Role: text' turns")
    return plain


def chat_head(render: Callable[[list[dict[str, str]]], str]) -> str:
    """The rendered system turn up to where the first user message's content starts."""
    text = render([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": SENTINEL}])
    return text[: text.index(SENTINEL)]


def user_message(documents: Sequence[str], question: str) -> str:
    """Documents then the question, as a RAG chain renders them."""
    return "\n\n".join(documents) + f"\n\nQuestion: {question}\nShort answer:"


def build_rag_prompts(
    items: Sequence[QAItem],
    docs: dict[str, str],
    pool: Sequence[str],
    k_values: Sequence[int],
    render: Callable[[list[dict[str, str]]], str],
    count_tokens: Callable[[str], int],
    limit: int,
    rng: random.Random,
    workload: str = "rag",
) -> list[BenchPrompt]:
    """One prompt per item: its document plus k-1 distractors, shuffled, under ``limit`` tokens.

    ``k`` is cycled over ``k_values``; ``workload`` labels the prompts (``"rag"`` or ``"qa"``).
    """
    prompts = []
    for i, item in enumerate(items):
        k = k_values[i % len(k_values)]
        distractors = rng.sample([t for t in pool if t != item.topic], min(k - 1, len(pool) - 1))
        topics = [item.topic, *distractors]
        rng.shuffle(topics)
        while True:
            text = render(
                [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": user_message([docs[t] for t in topics], item.question)},
                ]
            )
            tokens = count_tokens(text)
            if tokens <= limit or len(topics) == 1:
                break
            topics.remove(next(t for t in reversed(topics) if t != item.topic))
        if len(topics) < k:
            logger.info("prompt %d: %d documents instead of %d to stay under %d tokens", i, len(topics), k, limit)
        prompts.append(BenchPrompt(workload, i, text, [docs[t] for t in topics], item, len(topics), tokens))
    return prompts


def chat_messages(turns: Sequence[tuple[list[str], QAItem]], answers: Sequence[str]) -> list[dict[str, str]]:
    """The conversation up to the last turn: system, then user/assistant pairs."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i, (documents, item) in enumerate(turns):
        messages.append({"role": "user", "content": user_message(documents, item.question)})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def chat_plan(
    items: Sequence[QAItem], docs: dict[str, str], pool: Sequence[str], config: BenchConfig, rng: random.Random
) -> list[tuple[list[str], QAItem]]:
    """Per turn: the documents attached and the question asked (items cycled)."""
    plan = []
    for turn in range(config.chat_turns):
        item = items[(turn + 1) % len(items)]
        extra = rng.sample([t for t in pool if t != item.topic], max(0, min(config.chat_docs - 1, len(pool) - 1)))
        topics = [item.topic, *extra]
        rng.shuffle(topics)
        plan.append(([docs[t] for t in topics], item))
    return plan


# ---------------------------------------------------------------------------- metrics
def agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Share of positions two greedy outputs agree on, up to the first difference."""
    n = max(len(reference), len(other), 1)
    same = 0
    for x, y in zip(reference, other):
        if x != y:
            break
        same += 1
    return same / n


def make_record(
    prompt: BenchPrompt, info: Any, done: Completion, ref: Completion, token_ids: Callable[[str], list[int]]
) -> Record:
    """Compare one completion with the reference completion of the same prompt."""
    kl = top1 = None
    if done.first_logits is not None and ref.first_logits is not None:
        kl = first_token_kl(ref.first_logits, done.first_logits)
        top1 = float(int(ref.first_logits.argmax()) == int(done.first_logits.argmax()))
    if done.token_ids is not None:
        greedy = agreement(ref.token_ids or [], done.token_ids)
    else:
        greedy = agreement(token_ids(ref.text), token_ids(done.text))
    return Record(
        workload=prompt.workload,
        prompt=prompt.index,
        system=info.name,
        family=info.family,
        strategy=info.strategy,
        ratio=info.ratio,
        prompt_tokens=done.prompt_tokens or prompt.tokens,
        k=prompt.k,
        ttft_ms=done.ttft_ms,
        reported_ttft_ms=done.reported_ttft_ms,
        reuse=done.reuse,
        speedup=ref.ttft_ms / max(done.ttft_ms, 1e-9),
        kl=kl,
        top1=top1,
        greedy=greedy,
        exact=float(exact_match(done.text, prompt.item.answers)),
        text=done.text,
    )


# ---------------------------------------------------------------------------- systems
def build_systems(
    model: torch.nn.Module, tokenizer: Any, engine: KVBoost, config: BenchConfig, notes: list[str]
) -> list[System]:
    """The reference first, then every other system that can be built here."""
    warmer = EngineWarmer(engine)
    systems: list[System] = [TransformersGenerate(model, tokenizer), PrefixCacheGenerate(model, tokenizer)]
    try:
        systems.append(PyPIKVBoost(model, tokenizer, "cacheblend", config.adapter_ratio))
    except Exception as exc:  # optional: any import or setup failure only drops the row
        notes.append(f"PyPI kvboost row unavailable: {type(exc).__name__}: {exc}")
    if config.llamacpp:
        systems.extend(llamacpp_systems(config.threads))
    systems.append(KVBoostRagSystem(engine, warmer, "none", 0.0))
    for strategy in ("selective", "cacheblend", "attention"):
        systems.extend(KVBoostRagSystem(engine, warmer, strategy, r) for r in config.ratios)
    for adapter in (LangChainSystem, LlamaIndexSystem):
        try:
            systems.append(adapter(engine, warmer, "attention", config.adapter_ratio))
        except Exception as exc:  # adapters are separate packages; a broken one only drops its row
            notes.append(f"{adapter.__name__} row unavailable: {type(exc).__name__}: {exc}")
    for note in notes:
        logger.warning(note)
    return systems


def llamacpp_systems(threads: int, llama_cpp: Any = None) -> list[System]:
    """llama.cpp rows on the embedded GGUF, flash attention off and on.

    Raises:
        LlamaCppUnavailableError: llama-cpp-python or the GGUF is missing (the message names
            the install command).
    """
    return [
        LlamaCppSystem(threads=threads, flash_attention=flash, llama_cpp=llama_cpp) for flash in (False, True)
    ]


def warm_key(system: System) -> str:
    """Systems sharing one cache share one warm-up (the kvboost-rag rows share the engine)."""
    if system.info.family in ("kvboost-rag", "adapter"):
        return "kvboost-rag engine (all kvboost-rag and adapter rows)"
    return system.info.name


def warm_systems(
    systems: Sequence[System], head: str, documents: Sequence[str], result: BenchResult, progress: tqdm
) -> None:
    """First-call overheads out of the timings, then each cache warmed once (timed)."""
    for system in systems:
        progress.set_postfix_str(f"warm: {system.info.name}")
        system.run(head + "Hello", 2)
        key = warm_key(system)
        if key not in result.warm_seconds:
            seconds = system.warm(head, documents)
            if seconds > 0 or system.info.family != "baseline":
                result.warm_seconds[key] = seconds
        progress.update(1)


def run_prompt(
    systems: list[System],
    prompt: BenchPrompt,
    config: BenchConfig,
    result: BenchResult,
    progress: tqdm,
    token_ids: Callable[[str], list[int]],
) -> Completion:
    """Every live system on one prompt; returns the reference completion."""
    ref: Completion | None = None
    for system in list(systems):
        progress.set_postfix_str(f"{prompt.workload} {prompt.index}: {system.info.name}")
        try:
            done = system.run(prompt.text, config.new_tokens)
        except Exception as exc:
            if ref is None:
                raise
            logger.exception("%s failed; dropping it from the run", system.info.name)
            result.notes.append(
                f"{system.info.name} failed on {prompt.workload} prompt {prompt.index}: {type(exc).__name__}: {exc}"
            )
            systems.remove(system)
            progress.update(1)
            continue
        ref = ref or done
        record = make_record(prompt, system.info, done, ref, token_ids)
        result.records.append(record)
        logger.debug(
            "%s %d %s: %.0f ms, reuse %.2f, kl %s",
            prompt.workload,
            prompt.index,
            system.info.name,
            record.ttft_ms,
            record.reuse,
            record.kl,
        )
        progress.update(1)
    assert ref is not None
    return ref


# ---------------------------------------------------------------------------- the run
def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def code_version(root: Path | None = None, paths: tuple[str, ...] = ("kvboost_rag", "integrations", "bench")) -> str:
    """Git revision of the checkout at ``root`` (default: this bench's), flagged when ``paths``
    have local changes."""
    root = root or BENCH_DIR.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", *paths],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown (git not available)"
    if sha.returncode != 0:
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.stdout.splitlines() if not line[3:].startswith("bench/results")]
    return f"git {sha.stdout.strip()}" + (f" with local changes in {', '.join(changed)}" if changed else "")


def machine_line() -> str:
    """CPU, cores, torch threads, library versions and load."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} thread(s), "
        f"transformers {transformers.__version__}, Python {platform.python_version()}, load average at start {load}"
    )


def run_benchmark(
    model: torch.nn.Module,
    tokenizer: Any,
    config: BenchConfig,
    items: Sequence[QAItem] | None = None,
    show_progress: bool = True,
) -> BenchResult:
    """Run every system on the RAG and chat workloads.

    Args:
        model: The causal LM (eval mode).
        tokenizer: Its fast tokenizer (with a chat template).
        config: What to run.
        items: QA items (default: ``bench/qa.json``).
        show_progress: Show a progress bar.

    Returns:
        The per-prompt records, warm times and notes.
    """
    result = BenchResult(
        config=config,
        machine=machine_line(),
        code=code_version(),
        model=str(getattr(model.config, "_name_or_path", "") or model.config.model_type),
    )
    rng = random.Random(config.seed)
    all_items = list(items) if items is not None else load_qa()
    docs = cut_documents(config.doc_chars)
    items = usable_items(all_items, docs)[: config.questions]
    if not items:
        raise ValueError("no QA item has its answer inside the cut documents: raise --doc-chars")
    pool = document_pool(items, docs, config.pool, rng)
    qa_docs = cut_documents(config.qa_doc_chars)
    qa_items = usable_items(all_items, qa_docs)[: config.qa_questions]
    qa_pool = document_pool(qa_items, qa_docs, len({i.topic for i in qa_items}) + 2 * config.qa_k, rng)

    render = make_renderer(tokenizer)
    head = chat_head(render)
    engine = KVBoost.from_model(model, tokenizer, warm_prefix=head, show_progress=False)
    count = engine.count_tokens
    limit = engine.context_window - config.new_tokens - 8
    prompts = build_rag_prompts(items, docs, pool, config.k_values, render, count, limit, rng)
    prompts += build_rag_prompts(qa_items, qa_docs, qa_pool, [config.qa_k], render, count, limit, rng, "qa")
    plan = chat_plan(items, docs, pool, config, rng)
    warm_docs = list(dict.fromkeys([*(docs[t] for t in pool), *(qa_docs[t] for t in qa_pool if qa_items)]))

    systems = build_systems(model, tokenizer, engine, config, result.notes)
    total = len(systems) * (1 + len(prompts) + len(plan))
    with (
        logging_redirect_tqdm(),
        tqdm(total=total, desc="rag bench", unit="run", disable=not show_progress) as progress,
    ):
        warm_systems(systems, head, warm_docs, result, progress)
        for prompt in prompts:
            run_prompt(systems, prompt, config, result, progress, engine.token_ids)
        run_chat(systems, plan, render, count, limit, config, result, progress, engine.token_ids)
    return result


def run_chat(
    systems: list[System],
    plan: Sequence[tuple[list[str], QAItem]],
    render: Callable[[list[dict[str, str]]], str],
    count_tokens: Callable[[str], int],
    limit: int,
    config: BenchConfig,
    result: BenchResult,
    progress: tqdm,
    token_ids: Callable[[str], list[int]],
) -> None:
    """The multi-turn chat: each turn adds the reference answer to the history."""
    answers: list[str] = []
    for turn, (documents, item) in enumerate(plan):
        text = render(chat_messages(plan[: turn + 1], answers))
        tokens = count_tokens(text)
        if tokens > limit:
            result.notes.append(f"chat stopped after {turn} turns: turn {turn} would have {tokens} tokens")
            progress.update(len(systems) * (len(plan) - turn))
            return
        prompt = BenchPrompt("chat", turn, text, documents, item, len(documents), tokens)
        ref = run_prompt(systems, prompt, config, result, progress, token_ids)
        answers.append(ref.text)


# ---------------------------------------------------------------------------- tables
def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def system_order(records: Sequence[Record]) -> list[str]:
    """Systems in the order they ran."""
    return list(dict.fromkeys(r.system for r in records))


def summarize(records: Sequence[Record], workload: str) -> list[dict[str, Any]]:
    """Per system on one workload: median TTFT and speedup, mean reuse and quality."""
    rows = []
    for name in system_order(records):
        rs = [r for r in records if r.system == name and r.workload == workload]
        if not rs:
            continue
        rows.append(
            {
                "system": name,
                "family": rs[0].family,
                "strategy": rs[0].strategy,
                "ratio": rs[0].ratio,
                "prompts": len(rs),
                "ttft_ms": _median([r.ttft_ms for r in rs]),
                "speedup": _median([r.speedup for r in rs]),
                "reuse": _mean([r.reuse for r in rs]),
                "kl_mean": _mean([r.kl for r in rs]),
                "kl_median": _median([r.kl for r in rs]),
                "top1": _mean([r.top1 for r in rs]),
                "greedy": _mean([r.greedy for r in rs]),
                "exact": _mean([r.exact for r in rs]),
            }
        )
    return rows


def summary_table(rows: Sequence[dict[str, Any]], with_exact: bool) -> list[str]:
    """Markdown lines of a workload summary."""
    head = "| system | median TTFT ms | speedup | KV reuse | mean KL | median KL | top-1 | greedy agree |"
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"
    if with_exact:
        head, rule = head + " exact match |", rule + "---:|"
    lines = [head, rule]
    for row in rows:
        line = (
            f"| {row['system']} | {row['ttft_ms']:.0f} | {row['speedup']:.2f}x | {row['reuse']:.2f} | "
            f"{_fmt(row['kl_mean'], '.4f')} | {_fmt(row['kl_median'], '.4f')} | {_fmt(row['top1'], '.2f')} | "
            f"{row['greedy']:.2f} |"
        )
        if with_exact:
            line += f" {row['exact']:.2f} |"
        lines.append(line)
    return lines


def ttft_by_prompt_table(records: Sequence[Record], workload: str, label: str) -> list[str]:
    """Markdown lines: one column per prompt (documents and tokens), TTFT in ms per system."""
    rs = [r for r in records if r.workload == workload]
    prompts = sorted({r.prompt for r in rs})
    if not prompts:
        return []
    ref = {r.prompt: r for r in rs if r.system == REFERENCE}
    heads = [
        f"{label} {p}: {ref[p].k} docs, {ref[p].prompt_tokens} tok" if p in ref else f"{label} {p}" for p in prompts
    ]
    lines = ["| system | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(prompts)]
    for name in system_order(rs):
        by_prompt = {r.prompt: r.ttft_ms for r in rs if r.system == name}
        lines.append(f"| {name} | " + " | ".join(_fmt(by_prompt.get(p), ".0f") for p in prompts) + " |")
    return lines


def adapter_table(records: Sequence[Record]) -> list[str]:
    """Markdown lines: adapter TTFT against the direct engine call with the same settings."""
    lines = [
        "| adapter | workload | median TTFT ms | direct call median TTFT ms | median paired difference ms "
        "| same output as direct |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in system_order(records):
        adapter = [r for r in records if r.system == name and r.family == "adapter"]
        for workload in ("rag", "qa", "chat"):
            rs = [r for r in adapter if r.workload == workload]
            if not rs:
                continue
            direct = {
                r.prompt: r
                for r in records
                if r.family == "kvboost-rag"
                and r.workload == workload
                and r.strategy == rs[0].strategy
                and r.ratio == rs[0].ratio
            }
            pairs = [(r, direct[r.prompt]) for r in rs if r.prompt in direct]
            if not pairs:
                continue
            diff = statistics.median(a.ttft_ms - d.ttft_ms for a, d in pairs)
            same = statistics.fmean(float(a.text == d.text) for a, d in pairs)
            lines.append(
                f"| {name} | {workload} | {statistics.median(a.ttft_ms for a, _ in pairs):.0f} | "
                f"{statistics.median(d.ttft_ms for _, d in pairs):.0f} | {diff:+.1f} | {same:.2f} |"
            )
    return lines


def markdown_report(result: BenchResult) -> str:
    """The whole report: command, machine, summaries, per-prompt TTFT, adapters, warm-up."""
    cfg = result.config
    records = result.records
    rag, chat = [r for r in records if r.workload == "rag"], [r for r in records if r.workload == "chat"]
    lines = [
        "# kvboost-rag side-by-side RAG benchmark",
        "",
        f"Command: `{result.command}`",
        "",
        f"Machine: {result.machine}",
        "",
        f"Code: {result.code}",
        "",
        f"Model: {result.model}. Greedy decoding, {cfg.new_tokens} new tokens. "
        f"Reference for quality: {REFERENCE}. TTFT: wall time from the call to the first generated token.",
        "",
        f"## RAG prompts: system prompt + k shuffled documents + a question ({len({r.prompt for r in rag})} prompts, "
        f"k cycled over {', '.join(map(str, cfg.k_values))}, documents cut to {cfg.doc_chars} characters)",
        "",
        *summary_table(summarize(records, "rag"), with_exact=True),
        "",
        "### TTFT (ms) per RAG prompt",
        "",
        *ttft_by_prompt_table(records, "rag", "prompt"),
    ]
    qa = [r for r in records if r.workload == "qa"]
    if qa:
        lines += [
            "",
            f"## Exact-match QA: short prompts, {cfg.qa_k} shuffled documents cut to {cfg.qa_doc_chars} characters "
            f"({len({r.prompt for r in qa})} questions of qa.json)",
            "",
            *summary_table(summarize(records, "qa"), with_exact=True),
        ]
    if chat:
        lines += [
            "",
            f"## Multi-turn chat: history grows, {cfg.chat_docs} new document(s) per turn "
            f"({len({r.prompt for r in chat})} turns)",
            "",
            *summary_table(summarize(records, "chat"), with_exact=True),
            "",
            "### TTFT (ms) per chat turn",
            "",
            *ttft_by_prompt_table(records, "chat", "turn"),
        ]
    adapters = adapter_table(records)
    if len(adapters) > 2:
        lines += ["", "## Adapter overhead (same engine, same settings, same prompts)", "", *adapters]
    lines += ["", "## Prewarm (not part of TTFT)", "", "| cache | seconds |", "|---|---:|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in result.warm_seconds.items()]
    if result.notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in result.notes)]
    return "\n".join(lines) + "\n"


def write_outputs(result: BenchResult, out: Path) -> list[Path]:
    """Write ``results.md``, ``results.json`` and the plots; returns the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "results.md"
    report.write_text(markdown_report(result))
    raw = out / "results.json"
    payload = {
        "command": result.command,
        "machine": result.machine,
        "code": result.code,
        "model": result.model,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(result.config).items()},
        "warm_seconds": result.warm_seconds,
        "notes": result.notes,
        "records": [dataclasses.asdict(r) for r in result.records],
    }
    raw.write_text(json.dumps(payload, indent=1))
    summaries = {workload: summarize(result.records, workload) for workload in ("rag", "qa", "chat")}
    return [report, raw, *plots.write_plots(result.records, summaries, out, REFERENCE)]


def load_result(path: Path) -> BenchResult:
    """A run saved by :func:`write_outputs` (``results.json``)."""
    data = json.loads(Path(path).read_text())
    config = dict(data["config"])
    config["out"] = Path(config["out"])
    for name in ("k_values", "ratios"):
        config[name] = tuple(config[name])
    return BenchResult(
        config=BenchConfig(**config),
        records=[Record(**r) for r in data["records"]],
        warm_seconds=data["warm_seconds"],
        notes=data["notes"],
        machine=data["machine"],
        code=data.get("code", ""),
        command=data["command"],
        model=data["model"],
    )


# ---------------------------------------------------------------------------- CLI
def load_model(path: str | None) -> tuple[torch.nn.Module, Any]:
    """A local causal LM and its tokenizer (default: the embedded SmolLM2-135M-Instruct)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_rag.default_model import default_model_dir

    folder = default_model_dir() if path is None else Path(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tokenizer


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, BenchConfig]:
    """Command line to a config (``--quick`` presets, explicit flags win)."""
    base = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small run: {QUICK}")
    parser.add_argument("--model", default=None, help="local model folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=base.out, help="folder for results.md, results.json and PNGs")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 keeps ratios stable on busy machines)"
    )
    parser.add_argument("--questions", type=int, help=f"RAG prompts (default {base.questions})")
    parser.add_argument(
        "--k-values", help=f"documents per prompt, cycled (default {','.join(map(str, base.k_values))})"
    )
    parser.add_argument("--doc-chars", type=int, help=f"characters per document (default {base.doc_chars})")
    parser.add_argument("--pool", type=int, help=f"documents prompts draw from, all prewarmed (default {base.pool})")
    parser.add_argument(
        "--qa-questions", type=int, help=f"short exact-match QA prompts, 0 to skip (default {base.qa_questions})"
    )
    parser.add_argument("--qa-k", type=int, help=f"documents per QA prompt (default {base.qa_k})")
    parser.add_argument("--qa-doc-chars", type=int, help=f"characters per QA document (default {base.qa_doc_chars})")
    parser.add_argument(
        "--chat-turns", type=int, help=f"turns of the chat workload, 0 to skip (default {base.chat_turns})"
    )
    parser.add_argument("--chat-docs", type=int, help=f"documents per chat turn (default {base.chat_docs})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens per answer (default {base.new_tokens})")
    parser.add_argument("--ratios", help=f"recompute ratios (default {','.join(map(str, base.ratios))})")
    parser.add_argument("--seed", type=int, default=base.seed)
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="add llama.cpp rows (needs llama-cpp-python: pip install 'kvboost-rag[llamacpp]')",
    )
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="rewrite results.md and the plots from a saved results.json into --out (nothing is run)",
    )
    args = parser.parse_args(argv)
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    names = ("questions", "doc_chars", "pool", "qa_questions", "qa_k", "qa_doc_chars", "chat_turns", "chat_docs")
    for name in (*names, "new_tokens"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.k_values:
        values["k_values"] = tuple(int(k) for k in args.k_values.split(","))
    if args.ratios:
        values["ratios"] = tuple(float(r) for r in args.ratios.split(","))
    return args, BenchConfig(**values, seed=args.seed, out=args.out, llamacpp=args.llamacpp, threads=args.threads)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark from the command line and print the report."""
    args, config = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.from_json:
        result = load_result(args.from_json)
        paths = write_outputs(result, args.out)
        print(markdown_report(result))
        print("wrote " + ", ".join(str(p) for p in paths))
        return
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model)
    result = run_benchmark(model, tokenizer, config)
    result.command = "python " + " ".join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])])
    result.notes.append(
        f"wall time of the whole run: {(time.perf_counter() - started) / 60:.1f} min "
        f"(ended {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)"
    )
    paths = write_outputs(result, config.out)
    print(markdown_report(result))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
