"""The whole answer: decode speed and time to the last token against transformers ``generate``.

Chains, query engines and agents wait for the whole answer, so this measures it. Each prompt is
a RAG prompt in the model's chat template (``--plain`` for plain text): the system turn, then
``--docs`` reference documents (Python's reference topics cut to ``--doc-chars`` characters, in
a new order each prompt) and a question in the user turn. Three kinds of question: ones that ask
to quote a document, to explain one, and open ones. The documents and the system turn are warmed
first (as at ingest); then, back to back for each prompt, one after another in a rotating order:

- ``generate``: transformers ``model.generate`` on the same token ids, greedy, as many new tokens
  as the engine produced (``min_new_tokens`` too), timed from before tokenizing to its first
  streamed token and to its return;
- ``engine``: ``KVBoost.generate`` with the defaults (drafting on);
- ``no drafts``: the same engine with ``draft_tokens=0`` (plain one-token steps);
- ``llama.cpp`` (with ``--llamacpp GGUF``): llama-cpp-python's streamed ``create_completion`` on
  a GGUF of the same model (:mod:`llamacpp_system`), the same prompt text (it holds its chat
  template; llama.cpp adds a BOS only where the GGUF asks, Qwen2.5's and SmolLM2's do not),
  ``n_threads`` and ``n_threads_batch`` equal to ``--threads``, greedy (temperature 0, top_k 1,
  repeat_penalty 1.0) and exactly as many new tokens as the engine produced: every
  end-of-generation token (``token_eos()``, the end-of-turn token, and all the vocabulary marks
  so) gets a logit bias of -1e9, so it never stops early. TTFT is the wall time from the call
  to the first streamed piece, the total to the last. llama.cpp keeps the previous call's K/V
  and reuses its longest common token prefix with the next prompt (here the system turn: the
  documents come in a new order each prompt): its own behaviour, kept.

Per prompt it prints: prompt tokens, tokens generated, the **copy share** of the plain greedy
answers, ``generate``'s and the engine's without drafts (which differ where document reuse
changes the answer): the share of an answer's tokens that the continuation of the latest
earlier occurrence of their three preceding tokens, in the prompt or the answer so far,
predicts; the share of the engine's
answer tokens that were drafted and accepted, tokens accepted per verify step, decode tokens/s of
each row and their ratios to ``generate`` (decode: ``(tokens - 1) / (total - ttft)``), and the
whole answer's ratio (``generate`` total over engine total). Whether the engine's tokens equal
the no-draft row's (they must: drafting changes no greedy token) is checked on every prompt.
With ``--llamacpp``, also llama.cpp's prompt tokens (its own tokenizer), decode tokens/s, TTFT
and whole answer ms against the engine's whole answer ms, the whole answer's ratio (llama.cpp
total over engine total), the decode ratios no drafts / llama.cpp and engine / llama.cpp, and
how many leading tokens of llama.cpp's answer equal the no-draft row's (its weights are the
GGUF's quantized ones, the model folder's their float32 conversion); the summary gives the
ratios' medians.

Before the prompts, the **verify cost per row count**: one forward of 1, 2, 4, 8 and 16 tokens
over the first prompt's cache (its full prefill), as decode and verify steps run it
(a decode row of the engine loop's packed pass), with the linear layers' small-row kernel the engine chose at load
(:mod:`kvboost_rag.decode_weights.small_rows`) and with the model's own ``F.linear``, interleaved, the
median of ``--cost-reps``; each as a ratio to the one-token step. After the table, medians by
kind of question.

``--tiny-host`` adds the host-cost check: a random 32-layer Llama with 64-wide layers (its
forward passes cost little, so what is measured is the work around them), one thread, the
engine without drafts against ``generate``, decode ms per token.

Run: ``python bench/decode_bench.py --threads 2`` (``--prompts 9``, ``--new-tokens 96``,
``--docs 6``, ``--doc-chars 1600``, ``--plain``, ``--model PATH``, ``--tiny-host``,
``--cost-reps 7``, ``--decode-weights auto|model|int8``, ``--captured-steps auto|on|off``, ``--kv-cache-bits 8|4`` (documents and
prefixes stored quantized: they are dequantized into the prompt's float32 K/V when loaded, so
decode reads float32 K/V either way), ``--out FILE`` for the markdown report,
``--llamacpp [GGUF]`` for the llama.cpp row: the GGUF may be left out for the embedded model
and for ``bench/qwen_model.py``'s folder; needs ``pip install -e ".[llamacpp]"``).
The header gives the small-row kernel the engine chose, its weight copy's bytes, and resident
memory right after loading (before warming) against the parameters' bytes, whether decode and
verify steps run captured (``--captured-steps on``: compiled graphs, built before the prompts,
the load's seconds with their build; the verify-cost table, which times eager steps, is then
left out and the report ends with the count of captured steps run), and with ``--llamacpp`` the
llama-cpp-python version and the GGUF's quantization. An instruct model of another family:
``--model "$(python bench/qwen_model.py)"``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_topics
from kvboost_rag.default_model import cache_home
from kvboost_rag.dev.internals import internals
from llamacpp_system import LlamaCppSystem, embedded_gguf, end_of_generation_tokens, load_llama_cpp, stream_exact
from qwen_model import FOLDER as QWEN_FOLDER

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below, and quote them where they answer it."
)
#: (kind, question template): ``{topic}`` is the title of one of the prompt's documents.
QUESTIONS = (
    ("quote", "Quote the first two sentences of the document about {topic}, word for word."),
    ("explain", "Explain what the document about {topic} says, using its own words."),
    ("open", "Which of these documents would help a beginner most, and why?"),
)


class _Clock(BaseStreamer):
    """Notes when ``generate`` streams its first new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Run:
    """One answer: its tokens and its clock (``count``: tokens generated where ``tokens`` holds
    fewer, as llama.cpp's last token, streamed but never evaluated; 0: ``len(tokens)``)."""

    tokens: list[int]
    ttft_ms: float
    total_ms: float
    drafted: int = 0
    draft_steps: int = 0
    count: int = 0

    @property
    def produced(self) -> int:
        """Tokens generated."""
        return self.count or len(self.tokens)

    @property
    def decode_rate(self) -> float:
        """Tokens/s after the first token."""
        steps = self.produced - 1
        seconds = (self.total_ms - self.ttft_ms) / 1000
        return steps / seconds if steps > 0 and seconds > 0 else float("nan")


@torch.inference_mode()
def run_generate(model, tokenizer, prompt: str, new_tokens: int) -> Run:
    """transformers ``generate``, greedy, exactly ``new_tokens`` tokens."""
    clock = _Clock()
    start = time.perf_counter()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    end = time.perf_counter()
    return Run(out[0, ids.shape[1] :].tolist(), (clock.first - start) * 1000, (end - start) * 1000)


def run_engine(engine: KVBoost, prompt: str, new_tokens: int, draft_tokens: int) -> Run:
    """``KVBoost.generate`` with ``draft_tokens`` (the engine's settings are shared, so it is set per call)."""
    engine.settings.draft_tokens = draft_tokens
    result = engine.generate(prompt, max_new_tokens=new_tokens)
    return Run(result.token_ids, result.ttft_ms, result.total_ms, result.drafted_tokens, result.draft_steps)


def copy_share(prompt_ids: list[int], answer: list[int], n: int = 3) -> float:
    """Share of ``answer``'s tokens that the continuation of the latest earlier occurrence of
    their ``n`` preceding tokens (in the prompt or the answer before them) predicts."""
    sequence = list(prompt_ids)
    seen: dict[tuple[int, ...], int] = {}
    for i in range(len(sequence) - n):
        seen[tuple(sequence[i : i + n])] = sequence[i + n]
    hits = 0
    for token in answer:
        key = tuple(sequence[-n:])
        hits += seen.get(key) == token
        sequence.append(token)
        seen[key] = token
    return hits / len(answer) if answer else 0.0


def build_prompts(tokenizer, count: int, docs: int, doc_chars: int, plain: bool, seed: int) -> tuple[list[tuple[str, str]], list[str], str]:
    """``(kind, prompt)`` pairs, the documents to warm, and the system beginning to warm."""
    rng = random.Random(seed)
    topics = {name: text[:doc_chars] for name, text in python_reference_topics().items() if len(text) >= doc_chars}
    names = sorted(topics)
    prompts, warmed = [], set()
    for i in range(count):
        kind, question = QUESTIONS[i % len(QUESTIONS)]
        chosen = rng.sample(names, docs)
        warmed.update(chosen)
        topic = chosen[rng.randrange(docs)]
        context = "\n\n".join(f"Document: {name}\n{topics[name]}" for name in chosen)
        ask = question.format(topic=topic)
        if plain:
            prompt = f"{SYSTEM_PROMPT}\n\n{context}\n\nQuestion: {ask}\nAnswer:"
        else:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{context}\n\nQuestion: {ask}"}]
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append((kind, prompt))
    used = sorted(f"Document: {name}\n{topics[name]}" for name in warmed)  # the documents the prompts use
    first = prompts[0][1]
    beginning = first[: first.index("Document: ")]
    return prompts, used, beginning


@dataclass
class LlamaCppRow:
    """The llama.cpp row: the loaded GGUF and the tokens it must not sample."""

    system: LlamaCppSystem
    gguf: Path
    banned: list[int]
    threads: int

    def describe(self) -> str:
        """The header's words for it: version, file, quantization, threads."""
        return (
            f"llama.cpp row: llama-cpp-python {self.system.version} on {self.gguf.name} ({self.system.quantization}), "
            f"n_threads = n_threads_batch = {self.threads}, {len(self.banned)} end-of-generation tokens banned"
        )


def default_gguf(model: str | None) -> Path:
    """The GGUF of ``--model`` when ``--llamacpp`` names none: the embedded model's, or the one
    ``bench/qwen_model.py`` converted its folder from.

    Raises:
        SystemExit: Another model (its GGUF must be given), or the Qwen GGUF is gone.
    """
    if model is None:
        return embedded_gguf()
    if Path(model).name == QWEN_FOLDER:
        path = cache_home() / "gguf" / f"{QWEN_FOLDER}.gguf"
        if path.exists():
            return path
        raise SystemExit(f"{path} is missing: run python bench/qwen_model.py")
    raise SystemExit(f"--llamacpp: give the GGUF file of {model}")


def open_llamacpp(gguf: Path, threads: int, context: int, llama_cpp: Any = None) -> LlamaCppRow:
    """Loads ``gguf`` with ``threads`` threads for prompts and decoding and a ``context``-token window.

    Args:
        gguf: The model file.
        threads: ``n_threads`` and ``n_threads_batch``.
        context: ``n_ctx``.
        llama_cpp: The ``llama_cpp`` module (tests pass a stand-in); imported when ``None``.

    Raises:
        LlamaCppUnavailableError: llama-cpp-python is not installed.
    """
    module = llama_cpp if llama_cpp is not None else load_llama_cpp()
    system = LlamaCppSystem(gguf=gguf, threads=threads, context=context, llama_cpp=module)
    banned = end_of_generation_tokens(system.llm, module)
    metadata = getattr(system.llm, "metadata", None) or {}
    logger.info(
        "llama.cpp: %s, add_bos_token %s, end-of-generation tokens %s",
        gguf.name, metadata.get("tokenizer.ggml.add_bos_token", "unset"), banned,
    )
    return LlamaCppRow(system, gguf, banned, threads)


def run_llamacpp(row: LlamaCppRow, prompt: str, new_tokens: int) -> tuple[Run, int]:
    """llama.cpp's answer of exactly ``new_tokens`` tokens and its prompt's token count."""
    answer = stream_exact(row.system.llm, prompt, new_tokens, row.banned)
    if answer.produced != new_tokens:
        logger.warning("llama.cpp produced %d tokens, %d asked", answer.produced, new_tokens)
    return Run(answer.tokens, answer.ttft_ms, answer.total_ms, count=answer.produced), answer.prompt_tokens


def llamacpp_ratios(engine: Run, off: Run, llama: Run) -> tuple[float, float, float]:
    """Whole answer llama.cpp / engine (total ms), decode no drafts / llama.cpp and engine / llama.cpp (tokens/s)."""
    return llama.total_ms / engine.total_ms, off.decode_rate / llama.decode_rate, engine.decode_rate / llama.decode_rate


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def answer_rows(
    model, tokenizer, engine: KVBoost, prompt: str, index: int, new_tokens: int, llama: LlamaCppRow | None = None
) -> tuple[dict[str, Run], int]:
    """One prompt's answers: an engine answer of up to ``new_tokens`` sets the token count, then
    each row once, in an order rotated by ``index``. Returns them and llama.cpp's prompt tokens (0 without it)."""
    default_drafts = engine.settings.draft_tokens
    count = len(run_engine(engine, prompt, new_tokens, default_drafts).tokens)
    order = ["engine", "off", "generate"] + (["llama.cpp"] if llama is not None else [])
    shift = index % len(order)
    runs: dict[str, Run] = {}
    llama_prompt = 0
    for name in order[shift:] + order[:shift]:
        if name == "engine":
            runs[name] = run_engine(engine, prompt, count, default_drafts)
        elif name == "off":
            runs[name] = run_engine(engine, prompt, count, 0)
        elif name == "generate":
            runs[name] = run_generate(model, tokenizer, prompt, count)
        else:
            runs[name], llama_prompt = run_llamacpp(llama, prompt, count)
    engine.settings.draft_tokens = default_drafts
    return runs, llama_prompt


#: The llama.cpp row's columns, after the others.
LLAMA_COLUMNS = (
    "llama.cpp prompt tok | llama.cpp decode tok/s | llama.cpp TTFT / whole answer ms | engine whole answer ms | "
    "whole answer llama.cpp / engine | decode no drafts / llama.cpp | decode engine / llama.cpp | "
    "llama.cpp tokens equal to no drafts (leading) |"
)


def _llama_cells(llama: Run, prompt_tokens: int, e: Run, off: Run, ratios: tuple[float, float, float]) -> str:
    """One prompt's llama.cpp cells."""
    whole, nodraft, engine = ratios
    return (
        f" {prompt_tokens} | {llama.decode_rate:.1f} | {llama.ttft_ms:.0f} / {llama.total_ms:.0f} | {e.total_ms:.0f} | "
        f"{whole:.2f}x | {nodraft:.2f}x | {engine:.2f}x | {leading_equal(llama.tokens, off.tokens)} of {llama.produced} |"
    )


def whole_answer_table(
    model, tokenizer, engine: KVBoost, prompts: list[tuple[str, str]], new_tokens: int, llama: LlamaCppRow | None = None
) -> list[str]:
    """Runs every prompt through the rows (three, four with ``llama``) and returns the report's lines."""
    lines = [
        "| # | kind | prompt tok | new tok | copy share generate / engine | drafted share | accepted / verify | "
        "decode tok/s generate / engine / no drafts | decode engine / generate | no drafts / generate | "
        "whole answer generate / engine | same tokens as no drafts |" + (f" {LLAMA_COLUMNS}" if llama else ""),
        "|---:|---|---:|---:|---|---:|---:|---|---:|---:|---:|---|" + ("---:|" * 8 if llama else ""),
    ]
    decode, whole, nodraft, copying, same = [], [], [], [], 0
    by_kind: dict[str, list[tuple[float, float]]] = {}
    llama_ratios: list[tuple[float, float, float]] = []
    for i, (kind, prompt) in enumerate(prompts):
        runs, llama_prompt = answer_rows(model, tokenizer, engine, prompt, i, new_tokens, llama)
        e, off, g = runs["engine"], runs["off"], runs["generate"]
        prompt_ids = tokenizer(prompt).input_ids
        share, own = copy_share(prompt_ids, g.tokens), copy_share(prompt_ids, off.tokens)
        d_ratio, w_ratio, o_ratio = e.decode_rate / g.decode_rate, g.total_ms / e.total_ms, off.decode_rate / g.decode_rate
        if own >= 0.5:
            copying.append(d_ratio)
        decode.append(d_ratio), whole.append(w_ratio), nodraft.append(o_ratio)
        by_kind.setdefault(kind, []).append((d_ratio, w_ratio))
        identical = e.tokens == off.tokens
        same += identical
        per_verify = e.drafted / e.draft_steps if e.draft_steps else 0.0
        lines.append(
            f"| {i} | {kind} | {len(prompt_ids)} | {len(e.tokens)} | {share:.2f} / {own:.2f} | {e.drafted / max(1, len(e.tokens)):.2f} | "
            f"{per_verify:.2f} | {g.decode_rate:.1f} / {e.decode_rate:.1f} / {off.decode_rate:.1f} | {d_ratio:.2f}x | "
            f"{o_ratio:.2f}x | {w_ratio:.2f}x | {'yes' if identical else 'NO'} |"
        )
        if llama is not None:
            llama_ratios.append(llamacpp_ratios(e, off, runs["llama.cpp"]))
            lines[-1] += _llama_cells(runs["llama.cpp"], llama_prompt, e, off, llama_ratios[-1])
            if llama_prompt != len(prompt_ids):
                logger.info("prompt %d: llama.cpp reads %d tokens, the HF tokenizer %d", i, llama_prompt, len(prompt_ids))
        logging.info("%s", lines[-1])
    summary = _summary_lines(decode, nodraft, whole, copying, same, len(prompts), by_kind)
    return lines + summary[:2] + _llama_summary(llama, llama_ratios) + summary[2:]


def _llama_summary(llama: LlamaCppRow | None, ratios: list[tuple[float, float, float]]) -> list[str]:
    """The llama.cpp ratios' medians (no lines without the row)."""
    if llama is None or not ratios:
        return []
    whole, nodraft, engine = ([r[k] for r in ratios] for k in range(3))
    return [
        f"llama.cpp ({llama.system.quantization}): whole answer llama.cpp / engine median {statistics.median(whole):.2f}x "
        f"(min {min(whole):.2f}x); decode no drafts / llama.cpp median {statistics.median(nodraft):.2f}x, "
        f"engine / llama.cpp median {statistics.median(engine):.2f}x (min {min(engine):.2f}x)."
    ]


def _summary_lines(
    decode: list[float], nodraft: list[float], whole: list[float], copying: list[float], same: int, prompts: int,
    by_kind: dict[str, list[tuple[float, float]]],
) -> list[str]:
    """The whole-answer table's summary: medians over the prompts, then one row per kind."""
    return [
        "",
        f"Decode engine / generate: median {statistics.median(decode):.2f}x, min {min(decode):.2f}x, max {max(decode):.2f}x. "
        f"Without drafts: median {statistics.median(nodraft):.2f}x. "
        f"Whole answer: median {statistics.median(whole):.2f}x, min {min(whole):.2f}x. "
        f"Engine tokens equal to the no-draft engine's on {same} of {prompts} prompts. "
        + (
            f"Answers of which at least half the tokens are predictable (the engine's copy share >= 0.5): "
            f"{len(copying)}, decode min {min(copying):.2f}x, median {statistics.median(copying):.2f}x."
            if copying else "No answer had a copy share of 0.5 or more."
        ),
        "",
        "| kind | prompts | decode engine / generate, median (min) | whole answer, median (min) |",
        "|---|---:|---|---|",
        *(
            f"| {kind} | {len(pairs)} | {statistics.median(d for d, _ in pairs):.2f}x ({min(d for d, _ in pairs):.2f}x) | "
            f"{statistics.median(w for _, w in pairs):.2f}x ({min(w for _, w in pairs):.2f}x) |"
            for kind, pairs in by_kind.items()
        ),
    ]


WIDTHS = (1, 2, 4, 8, 16)


@torch.inference_mode()
def verify_cost_table(engine: KVBoost, prompt: str, reps: int) -> list[str]:
    """One forward of 1-16 tokens over ``prompt``'s cache, as decode and verify steps run it,
    with the engine's small-row kernel and with ``F.linear``: median ms and ratio to 1 token."""
    from kvboost_rag.hf.caches import truncate_cache
    from kvboost_rag.hf.decode_pass import DecodePass
    from kvboost_rag.hf.packed import Segment
    from kvboost_rag.decode_weights.small_rows import SmallRowLinears

    adapter = internals(engine).adapter
    ids = engine.tokenizer(prompt).input_ids
    cache = adapter.new_cache(len(ids) + max(WIDTHS))
    adapter.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
    chosen, plain = adapter.small_rows, SmallRowLinears()  # an "off" instance routes nothing
    # The direct decode pass holds its layers' products: one over F.linear for the plain rounds.
    chosen_pass = adapter.decode_pass
    plain_pass = None if chosen_pass is None else DecodePass(adapter.model, plain)
    seconds: dict[tuple[str, int], list[float]] = {}
    try:
        for rep in range(reps + 1):  # the first round warms up
            for name, kernel, decode_pass in (("kernel", chosen, chosen_pass), ("F.linear", plain, plain_pass)):
                adapter.small_rows, adapter.decode_pass = kernel, decode_pass
                for width in WIDTHS:
                    start = time.perf_counter()
                    row = Segment(torch.tensor(ids[-width:]), torch.arange(len(ids), len(ids) + width), cache, logits=width, decode=True)
                    adapter.forward_segments([row])
                    if rep:
                        seconds.setdefault((name, width), []).append(time.perf_counter() - start)
                    truncate_cache(cache, len(ids))
    finally:
        adapter.small_rows, adapter.decode_pass = chosen, chosen_pass
    ms = {key: 1000 * statistics.median(values) for key, values in seconds.items()}
    lines = [
        f"Verify cost per row count over a {len(ids)}-token cache (median of {reps}; small-row kernel: "
        f"{chosen.kernel}):",
        "",
        "| tokens | ms, engine's kernel | / 1 token | ms, F.linear | / 1 token | F.linear / engine's kernel |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for width in WIDTHS:
        k, f = ms[("kernel", width)], ms[("F.linear", width)]
        lines.append(
            f"| {width} | {k:.1f} | {k / ms[('kernel', 1)]:.2f}x | {f:.1f} | {f / ms[('F.linear', 1)]:.2f}x | {f / k:.2f}x |"
        )
    return lines


def tiny_host_table(new_tokens: int) -> list[str]:
    """Decode ms per token of a random 32-layer, 64-wide Llama, one thread: the engine without
    drafts against ``generate`` (the work around forward passes)."""
    from gpu_bench import build_model, load_tokenizer

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    model = build_model("tiny", 32, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer("embedded")
    engine = KVBoost.from_model(model, tokenizer, draft_tokens=0, show_progress=False)
    prompt = "\n\n".join(list(python_reference_topics().values())[:3])[:3000] + "\nQuestion: what?\nAnswer:"
    engine_ms, generate_ms = [], []
    for _ in range(5):
        e = run_engine(engine, prompt, new_tokens, 0)
        g = run_generate(model, tokenizer, prompt, len(e.tokens))
        engine_ms.append(1000 / e.decode_rate)
        generate_ms.append(1000 / g.decode_rate)
    torch.set_num_threads(previous)
    e, g = statistics.median(engine_ms), statistics.median(generate_ms)
    return [
        "| tiny 32-layer Llama, 1 thread | engine ms/token (no drafts) | generate ms/token | engine speed / generate |",
        "|---|---:|---:|---:|",
        f"| median of 5 | {e:.2f} | {g:.2f} | {g / e:.2f}x |",
    ]


def _resident_bytes() -> int:
    """This process's resident memory (``VmRSS``; 0 where ``/proc`` has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _llamacpp_gguf(args: argparse.Namespace) -> Path | None:
    """The GGUF ``--llamacpp`` asks for (``None`` without it), checked before any model loads.

    Raises:
        LlamaCppUnavailableError: llama-cpp-python is not installed.
        SystemExit: No GGUF is given or found.
    """
    if args.llamacpp is None:
        return None
    load_llama_cpp()
    gguf = Path(args.llamacpp) if args.llamacpp else default_gguf(args.model)
    if not gguf.is_file():
        raise SystemExit(f"--llamacpp: {gguf} is not a file")
    return gguf


def _llamacpp_row(gguf: Path | None, threads: int, new_tokens: int, tokenizer, prompts: list[tuple[str, str]]) -> LlamaCppRow | None:
    """The llama.cpp row on ``gguf`` (``None`` without one), its window twice the longest prompt
    plus the answer, at least 8192 tokens."""
    if gguf is None:
        return None
    longest = max(len(tokenizer(prompt).input_ids) for _, prompt in prompts)
    return open_llamacpp(gguf, threads, max(8192, 2 * longest + new_tokens))


def _captured_note(engine: KVBoost, load_s: float) -> str:
    """What the header says of captured steps: off, or the buckets built before the prompts
    and the load's seconds (their compile included)."""
    if engine.captured_steps_run is None:
        return "captured steps off"
    return f"captured steps on, buckets {list(internals(engine).captured.ready_buckets)}, load with their build {load_s:.0f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-chars", type=int, default=1600)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--plain", action="store_true", help="plain prompts instead of the chat template")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-host", action="store_true", help="also the host-cost check on a tiny 32-layer model")
    parser.add_argument("--cost-reps", type=int, default=7, help="rounds of the verify-cost table (0: none)")
    parser.add_argument(
        "--decode-weights", choices=("auto", "model", "int8", "stored"), default="auto",
        help="what the engine's decode and verify steps read (the engine's decode_weights setting)",
    )
    parser.add_argument(
        "--kv-cache-bits", type=int, choices=(8, 4), default=None,
        help="the engine's kv_cache_bits: documents and prefixes stored quantized (default: the model's dtype)",
    )
    parser.add_argument(
        "--captured-steps", choices=("auto", "on", "off"), default="auto",
        help="the engine's captured_steps (on: decode and verify steps as compiled graphs, built before the prompts)",
    )
    parser.add_argument(
        "--llamacpp", nargs="?", const="", default=None, metavar="GGUF",
        help="add the llama.cpp row on this GGUF of the same model (left out: the embedded model's, or "
        "qwen_model.py's for its folder); needs pip install -e '.[llamacpp]'",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gguf = _llamacpp_gguf(args)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    engine = KVBoost.from_pretrained(
        args.model, show_progress=False, decode_weights=args.decode_weights, kv_cache_bits=args.kv_cache_bits,
        captured_steps=args.captured_steps, captured_build="at_load",
    )
    load_s = time.perf_counter() - started
    resident = _resident_bytes()
    model, tokenizer = engine.model, engine.tokenizer
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    prompts, documents, beginning = build_prompts(tokenizer, args.prompts + 1, args.docs, args.doc_chars, args.plain, args.seed)
    engine.warm(beginning)
    engine.warm_documents(documents)
    llama = _llamacpp_row(gguf, args.threads, args.new_tokens, tokenizer, prompts)
    warmup = prompts.pop(0)[1]  # one untimed answer each: first-call costs are not decoding
    engine.generate(warmup, max_new_tokens=8)
    run_generate(model, tokenizer, warmup, 8)
    if llama is not None:
        run_llamacpp(llama, warmup, 8)
    header = (
        f"decode_bench: {engine.model_name}, {'plain' if args.plain else 'chat'} prompts of {args.docs} documents "
        f"({args.doc_chars} chars), {args.new_tokens} new tokens, greedy, {args.threads} torch threads, "
        f"torch {torch.__version__}, decode_weights={args.decode_weights}, kv_cache_bits={args.kv_cache_bits}: small-row kernel {engine.small_row_kernel}, "
        f"{engine.four_bit_layers} layers read as stored 4-bit runs (copies {internals(engine).adapter.small_rows.copy_bytes / 1e6:.0f} MB), resident after load {resident / 1e6:.0f} MB "
        f"({resident / params:.2f}x the {params / 1e6:.0f} MB of parameters), load average {os.getloadavg()[0]:.1f} at the start; "
        f"{_captured_note(engine, load_s)}"
    ) + (f"; {llama.describe()}" if llama is not None else "")
    lines = [header, ""]
    if args.cost_reps and engine.captured_steps_run is None:  # the table times eager steps
        lines += [*verify_cost_table(engine, prompts[0][1], args.cost_reps), ""]
    lines += whole_answer_table(model, tokenizer, engine, prompts, args.new_tokens, llama)
    lines.append(f"Load average {os.getloadavg()[0]:.1f} at the end.")
    if engine.captured_steps_run is not None:
        lines.append(f"Captured steps run: {engine.captured_steps_run}.")
    if args.tiny_host:
        lines += ["", *tiny_host_table(64)]
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
