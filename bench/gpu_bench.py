"""TTFT and decode speed at real model shapes, with random weights: no hub, any device.

Timing does not depend on weight values, so the model is built from a named shape's config
(written below, no download) with random weights, in the requested dtype on the requested
device, and fed the embedded SmolLM2 tokenizer's tokens (all ids fit every shape's vocabulary).
For each prompt length (a system prompt, retrieved documents: the reference documents cut the
way a RAG text splitter cuts them, at most ``--doc-tokens`` each, and a question) one run
measures, each the median of ``--repeats`` calls after a warm-up:

- full prefill through transformers (SDPA, one ``model(...)`` call on a fresh cache,
  tokenizing and taking the first token included): the baseline;
- an exact prefix repeat through the engine (the same prompt again) and its speedup;
- document reuse with the engine's default repair (the strategy and ratio in use are printed):
  the documents warmed behind the system prompt, the prompt holding them in another order, and
  its speedup;
- engine overhead: the engine's TTFT minus the time spent inside the model's forward calls
  and minus tokenizing (the engine's own tokenize stage in the same call: full prefill pays
  it too), that is plan, lookup, loading, stitching, re-rotation, selection and sampling, for
  the prefix repeat and for document reuse;
- what one call does, as ``torch.profiler`` sees it (:func:`kvboost_rag.dev.op_counts.profile_counts`,
  an untimed call of its own): ``aten::copy_`` calls, host reads of tensor values, and on CUDA
  kernel launches, runtime memory copies and host synchronizations;
- decode tokens/s of the engine against ``model.generate`` (greedy, same prompt, same length;
  both ``(tokens - 1) / (time of the last token - time of the first)``; the engine's write-back
  of the prompt's K/V, which a blocking ``generate`` waits for after its last token, is timed
  apart).

With ``--captured`` a decode table follows (``--decode-only``: only it), measured in the same
run for each length: ``model.generate``, the engine's eager decode steps, and captured steps
(:mod:`kvboost_rag.hf.captured`: compiled graphs over a static K/V pool, CUDA graphs on CUDA;
``bench/captured_decode.py``): tokens/s, launches and host time per step, the greedy tokens
shared with ``generate``, and the time to build the step (compile and capture, with the compiled
graphs found in torch's on-disk cache). ``--engine-captured`` adds the engine's own calls on an
engine built with captured steps (``--captured-buckets``, each compiled at load; drafting on):
decode tokens/s, the call's end after its last piece, how long a flush then waited for the
write-back, the write-back's copies into host memory in GB/s, the share of the prompt a call
right after it read from cache, the drafted share, the steps run captured, and where its greedy
tokens part from ``generate``'s, ``generate``'s logit margin there (top less second: near zero
is a tie within rounding). ``--engine-defaults`` builds that engine with every setting at its
default (the pool and the device tier sized from the free device memory, the buckets built in
the background).

Run on a GPU: ``python bench/gpu_bench.py --device cuda --dtype bfloat16 --shape Llama-3.1-8B``.
A CPU smoke run: ``python bench/gpu_bench.py --shape Llama-3.1-8B --layers 1 --lengths 1024,2048``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.op_counts import RuntimeCounts, profile_counts
from kvboost_rag.diagnosis.stage_times import record_stages
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.attention_backends.sparse import BACKENDS, default_backend, use_backend
from kvboost_rag.dev.internals import internals

sys.path.insert(0, str(Path(__file__).resolve().parent))
from captured_decode import CapturedDecode, CapturedLoop, EngineDecode, engine_decode, same_prefix, split_margin  # noqa: E402

#: The stages one call's stage times are printed for, in order (kvboost_rag.diagnosis.stage_times).
STAGES = ("find", "tokenize", "plan", "lookup", "stitch", "probe", "select", "blend")
SYSTEM_PROMPT = (
    "You are a precise assistant for Python programmers. Answer the question using only the "
    "reference documents below, quote the relevant rule and keep the answer short."
)
QUESTION = "\n\nQuestion: Which of these documents describes the evaluation order?\nAnswer:"

#: Named shapes: ``(model_type, config fields)`` from the models' published configs.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama-3.1-8B": (
        "llama",
        dict(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "Qwen2.5-7B": (
        "qwen2",
        dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
            tie_word_embeddings=False, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "Mistral-7B": (
        "mistral",
        dict(
            vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
            tie_word_embeddings=False, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "SmolLM2-135M": (
        "llama",
        dict(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
    ),
    "tiny": (
        "llama",
        dict(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}


def build_model(shape: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight causal LM of a named shape (optionally fewer layers), on ``device``."""
    model_type, fields = SHAPES[shape]
    fields = dict(fields)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load_tokenizer(name: str):
    """The embedded SmolLM2 tokenizer (``embedded``), the tests' tiny one (``tiny``), or the
    tokenizer saved in a folder (``tokenizer.json`` and its config: a copy of the embedded
    one carried to a machine without the embedded model, see ``scripts/gpu_wheels.sh``)."""
    if name == "tiny":
        from kvboost_rag.dev.testing import tiny_tokenizer

        return tiny_tokenizer()
    if name == "embedded":
        from kvboost_rag.default_model import default_model_dir

        return AutoTokenizer.from_pretrained(default_model_dir())
    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def split_documents(tokenizer, doc_tokens: int) -> list[str]:
    """The reference documents cut the way a RAG text splitter cuts them: paragraphs packed
    into pieces of at most ``doc_tokens`` tokens, a longer paragraph cut on token boundaries."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    pieces: list[str] = []
    for text in python_reference_documents():
        current: list[str] = []
        size = 0
        for paragraph in (p.strip() for p in text.split("\n\n")):
            if not paragraph:
                continue
            tokens = count(paragraph)
            if current and size + tokens > doc_tokens:
                pieces.append("\n\n".join(current))
                current, size = [], 0
            if tokens > doc_tokens:
                ids = tokenizer(paragraph, add_special_tokens=False).input_ids
                pieces.extend(tokenizer.decode(ids[i : i + doc_tokens]).strip() for i in range(0, len(ids), doc_tokens))
                continue
            current.append(paragraph)
            size += tokens
        if current:
            pieces.append("\n\n".join(current))
    return [piece for piece in pieces if len(piece) >= 64]


def split_characters(doc_chars: int) -> list[str]:
    """The reference documents cut the way a character text splitter cuts them: paragraphs
    packed into pieces of at most ``doc_chars`` characters, a longer paragraph cut at the last
    whitespace before the limit (at the limit where there is none)."""
    pieces: list[str] = []
    for text in python_reference_documents():
        current = ""
        for paragraph in (p.strip() for p in text.split("\n\n")):
            while len(paragraph) > doc_chars:
                cut = max(paragraph.rfind(" ", 0, doc_chars), paragraph.rfind("\n", 0, doc_chars))
                cut = cut if cut > doc_chars // 2 else doc_chars
                pieces.append(paragraph[:cut].strip())
                paragraph = paragraph[cut:].strip()
            if current and len(current) + 2 + len(paragraph) > doc_chars:
                pieces.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if current:
            pieces.append(current)
    return [piece for piece in pieces if len(piece) >= 64]


def build_prompt(
    tokenizer, tokens: int, seed: int, doc_tokens: int = 512, doc_chars: int | None = None
) -> tuple[str, list[str], str]:
    """``(prompt, documents, same documents in another order as a prompt)`` of about
    ``tokens`` tokens: the system prompt, retrieved documents (reference documents cut into
    pieces of at most ``doc_tokens`` tokens, or of at most ``doc_chars`` characters when
    given; a seeded random choice), the question."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    budget = tokens - count(SYSTEM_PROMPT) - count(QUESTION)
    pool = split_characters(doc_chars) if doc_chars else split_documents(tokenizer, doc_tokens)
    random.Random(seed).shuffle(pool)
    documents: list[str] = []
    for text in pool:
        if budget < 64:
            break
        size = count(text) + 2
        if size <= budget:
            documents.append(text)
            budget -= size
    shuffled = documents[:]
    random.Random(seed + 1).shuffle(shuffled)
    if shuffled == documents:  # another order, always
        shuffled = shuffled[1:] + shuffled[:1]
    join = lambda docs: SYSTEM_PROMPT + "\n\n" + "\n\n".join(docs) + QUESTION  # noqa: E731
    return join(documents), documents, join(shuffled)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ForwardTimer:
    """Wall time spent inside the model's forward calls (outermost call only), and inside the
    captured passes of each of ``captured`` (a CUDA graph replays the model without
    calling its ``forward``)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, captured: Sequence = ()) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._device = device
        base = getattr(model, model.base_model_prefix)
        self._patched = [(model, "forward"), (base, "forward")] + [(rows, "run") for rows in captured if rows is not None]
        for owner, name in self._patched:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def remove(self) -> None:
        """Stop timing: the modules' own ``forward`` again."""
        for owner, name in self._patched:
            delattr(owner, name)

    def _timed(self, forward: Callable) -> Callable:
        def timed(*args, **kwargs):
            if torch.compiler.is_compiling():  # traced into a compiled step: no clock there
                return forward(*args, **kwargs)
            self._depth += 1
            if self._depth == 1:
                sync(self._device)
                start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    sync(self._device)
                    self.seconds += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def measure(self) -> Iterator[list[float]]:
        """Yields a list that holds the model seconds of the block once it ends."""
        before, box = self.seconds, []
        yield box
        box.append(self.seconds - before)


@dataclass
class Row:
    prompt_tokens: int
    documents: int
    tokenize_ms: float
    full_ms: float
    prefix_ms: float
    prefix_overhead_ms: float
    blend_ms: float
    blend_overhead_ms: float
    recompute_ratio: float
    engine_tps: float
    generate_tps: float
    prefix_ops: RuntimeCounts
    blend_ops: RuntimeCounts
    stages: dict[str, float]


def median_ms(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


def measure(engine: KVBoost, timer: ForwardTimer, tokens: int, args, device: torch.device) -> Row:
    model, tokenizer = engine.model, engine.tokenizer
    prompt, documents, shuffled = build_prompt(tokenizer, tokens, seed=tokens, doc_tokens=args.doc_tokens, doc_chars=args.doc_chars)
    n = engine.count_tokens(prompt)

    @torch.inference_mode()
    def full_prefill() -> float:
        sync(device)
        start = time.perf_counter()
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
        int(logits[0, -1].argmax())
        return (time.perf_counter() - start) * 1000

    def tokenize() -> float:
        start = time.perf_counter()
        engine.token_ids_with_offsets(prompt)
        return (time.perf_counter() - start) * 1000

    tokenize_ms = median_ms(tokenize, 5)

    def engine_call(text: str, check: Callable) -> tuple[float, float]:
        with timer.measure() as model_s, record_stages(synchronize=False) as stages:
            result = engine.generate(text, max_new_tokens=1)
        check(result)
        return result.ttft_ms, result.ttft_ms - model_s[0] * 1000 - stages.get("tokenize", 0.0)  # finding documents stays in

    full_prefill()
    full_ms = median_ms(full_prefill, args.repeats)

    engine.clear_cache()
    engine.generate(prompt, max_new_tokens=1)  # stores the whole prompt as prefix chunks

    def exact(result) -> None:
        assert result.strategy == "exact" and result.prefix_hit_tokens >= n - args.chunk_size, result

    prefix = [engine_call(prompt, exact) for _ in range(args.repeats)]
    prefix_ops = counted(engine, prompt)

    engine.clear_cache()
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(documents, show_progress=False)
    ratios: list[float] = []

    def blended(result) -> None:
        assert result.strategy == engine.settings.recompute_strategy and result.content_hit_tokens > 0, result
        ratios.append(result.recompute_ratio)

    blend = [engine_call(shuffled, blended) for _ in range(args.repeats)]
    blend_ops = counted(engine, shuffled)
    with record_stages() as stages:  # an untimed call: the device is synchronized at each stage
        engine.generate(shuffled, max_new_tokens=1)

    engine_tps = engine_decode_rate(engine, prompt, args.decode_tokens)
    generate_tps = generate_decode_rate(model, tokenizer, prompt, args.decode_tokens, device)
    return Row(
        prompt_tokens=n,
        documents=len(documents),
        tokenize_ms=tokenize_ms,
        full_ms=full_ms,
        prefix_ms=statistics.median(p[0] for p in prefix),
        prefix_overhead_ms=statistics.median(p[1] for p in prefix),
        blend_ms=statistics.median(b[0] for b in blend),
        blend_overhead_ms=statistics.median(b[1] for b in blend),
        recompute_ratio=statistics.median(ratios),
        engine_tps=engine_tps,
        generate_tps=generate_tps,
        prefix_ops=prefix_ops,
        blend_ops=blend_ops,
        stages=dict(stages),
    )


def profile_one_call(engine: KVBoost, tokens: int, args) -> None:
    """Print where one document-reuse call of ``tokens`` tokens spends its time, as the
    profiler sees it: the top operations by time on the host and on the device."""
    from torch.profiler import ProfilerActivity, profile

    _, documents, shuffled = build_prompt(
        engine.tokenizer, tokens, seed=tokens, doc_tokens=args.doc_tokens, doc_chars=args.doc_chars
    )
    engine.warm_documents(documents, show_progress=False)
    engine.generate(shuffled, max_new_tokens=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        engine.generate(shuffled, max_new_tokens=1)
    averages = profiler.key_averages()
    print(f"profile of one repair call at {tokens} tokens, by host time:")
    print(averages.table(sort_by="cpu_time_total", row_limit=args.profile))
    if torch.cuda.is_available():
        print("by device time:")
        print(averages.table(sort_by="cuda_time_total", row_limit=args.profile))


def counted(engine: KVBoost, prompt: str) -> RuntimeCounts:
    """What one call to the first token does, as the profiler sees it (an untimed call of its
    own): copies, host reads, and on CUDA kernel launches, runtime copies and syncs."""
    return profile_counts(lambda: engine.generate(prompt, max_new_tokens=1))


def engine_decode_rate(engine: KVBoost, prompt: str, tokens: int) -> float:
    """The engine's greedy decode rate after its first token, to its last (the write-back
    after it is not decoding: :func:`captured_decode.engine_decode` times it apart)."""
    return engine_decode(engine, prompt, tokens).tokens_per_s


class _FirstTokenClock(BaseStreamer):
    """Notes when ``generate`` hands over its first new token (its first ``put`` is the prompt)."""

    def __init__(self, device: torch.device) -> None:
        self.calls, self.first, self._device = 0, 0.0, device

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            sync(self._device)
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def generate_decode_rate(
    model, tokenizer, prompt: str, tokens: int, device: torch.device, produced: list[int] | None = None,
    margins: list[float] | None = None,
) -> float:
    """Tokens/s of ``model.generate`` after its first token (as the engine's rate is taken);
    its greedy tokens go into ``produced`` and each step's logit margin (top less second)
    into ``margins`` when given."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    clock = _FirstTokenClock(device)
    out = model.generate(
        ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=clock,
        pad_token_id=tokenizer.pad_token_id or 0, output_scores=margins is not None, return_dict_in_generate=True,
    )
    sync(device)
    if produced is not None:
        produced.extend(out.sequences[0, ids.shape[1] :].tolist())
    if margins is not None:
        top = torch.stack(out.scores).float().topk(2, dim=-1).values  # [tokens, 1, 2]
        margins.extend((top[:, 0, 0] - top[:, 0, 1]).tolist())
    return (tokens - 1) / (time.perf_counter() - clock.first) if tokens > 1 else float("nan")


@dataclass
class DecodeRow:
    prompt_tokens: int
    generate_tps: float
    engine_tps: float
    captured: CapturedDecode | None
    same_tokens: int
    captured_margin: float | None
    engine_captured: EngineDecode | None
    engine_same_tokens: int
    engine_margin: float | None


def measure_decode(
    engine: KVBoost, loop: CapturedLoop | None, captured_engine: KVBoost | None, tokens: int, args, device: torch.device
) -> DecodeRow:
    """Decode rates at a prompt of about ``tokens`` tokens: ``model.generate``, the engine
    (eager decode steps), with ``--captured`` the captured loop, with ``--engine-captured`` the
    engine's ``generate`` through captured steps; how many leading greedy tokens each shares
    with ``generate``, and ``generate``'s logit margin where they part."""
    prompt, _, _ = build_prompt(engine.tokenizer, tokens, seed=tokens, doc_tokens=args.doc_tokens)
    ids = torch.tensor(engine.tokenizer(prompt, add_special_tokens=False).input_ids)
    reference: list[int] = []
    margins: list[float] = []
    generate_tps = generate_decode_rate(engine.model, engine.tokenizer, prompt, args.decode_tokens, device, reference, margins)
    engine_tps = engine_decode_rate(engine, prompt, args.decode_tokens)
    captured = loop.measure(ids, args.decode_tokens) if loop is not None else None
    through = engine_decode(captured_engine, prompt, args.decode_tokens) if captured_engine is not None else None
    return DecodeRow(
        ids.shape[0], generate_tps, engine_tps, captured,
        same_prefix(captured.tokens, reference) if captured is not None else 0,
        split_margin(captured.tokens, reference, margins) if captured is not None else None,
        through,
        same_prefix(through.tokens, reference) if through is not None else 0,
        split_margin(through.tokens, reference, margins) if through is not None else None,
    )


def _captured_engine(engine: KVBoost, lengths: list[int], args) -> KVBoost | None:
    """An engine over the same model with captured steps (``--engine-captured``): with
    ``--engine-defaults`` every setting at its default (the pool and the device tier planned
    from the free device memory, the buckets built in the background, waited for here); else
    its pool holds a slot for the longest prompt and its decoded tokens, and ``--captured-buckets``
    are built at load."""
    started = time.perf_counter()
    if args.engine_defaults:
        built = KVBoost.from_model(engine.model, engine.tokenizer, show_progress=False)
        constructed = time.perf_counter() - started
        built.wait_for_captured_steps()
        what = f"defaults: constructor {constructed:.1f} s, buckets ready after"
    else:
        built = KVBoost.from_model(
            engine.model, engine.tokenizer, show_progress=False, chunk_size=args.chunk_size, captured_steps="on",
            captured_token_buckets=tuple(int(b) for b in args.captured_buckets.split(",")),
            captured_pool_bytes=pool_bytes(engine.model, lengths, args.decode_tokens), captured_build="at_load",
        )
        what = f"buckets {args.captured_buckets}, built at load in"
    if built.captured_steps_run is None or not internals(built).captured.available:
        print("the engine's captured steps were not built (see the log): its column is left out")
        return None
    slots = sorted((slot.capacity for slot in internals(built).captured.pool.slots), reverse=True)
    print(f"engine with captured steps ({what} {time.perf_counter() - started:.1f} s); pool slots {slots}")
    return built


def pool_bytes(model: torch.nn.Module, lengths: list[int], decode_tokens: int) -> int:
    """Bytes of a captured steps' pool with a slot for the longest prompt and its decoded
    tokens (a slot of the next power of two, and smaller ones)."""
    longest = max(lengths) + decode_tokens + 8
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * dim * model.dtype.itemsize
    return 3 * (1 << (longest - 1).bit_length()) // 2 * per_token


def _margin(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _decode_table(engine: KVBoost, lengths: list[int], args, device: torch.device) -> list[DecodeRow]:
    """The decode table: one row per prompt length."""
    loop = None
    if args.captured:
        try:
            loop = CapturedLoop(ModelAdapter(engine.model, engine.tokenizer), max(lengths) + args.decode_tokens + 8)
        except RuntimeError as exc:  # the table still compares the eager steps with generate
            print(f"captured steps not available: {exc}")
        else:
            print(
                f"captured step built in {loop.prepare_s:.1f} s (compiled graphs: {loop.cache_hits} from torch's "
                f"on-disk cache, {loop.cache_misses} compiled)"
            )
    captured_engine = _captured_engine(engine, lengths, args) if args.engine_captured else None
    print(
        "| prompt tokens | model.generate tok/s | engine (eager steps) tok/s | captured tok/s | captured / generate | "
        "captured / eager | launches per step eager / captured | host ms per step eager / captured | "
        f"greedy tokens as generate (of {args.decode_tokens}) | generate's margin there | "
        "engine.generate captured tok/s | / generate | call end after the last piece ms | flush after it ms | "
        "write-back copies GB/s | next call's tokens from cache | drafted share | "
        "tokens per step | captured steps | greedy tokens as generate | generate's margin there |"
    )
    print("|---" * 21 + "|")
    rows = []
    for tokens in lengths:
        row = measure_decode(engine, loop, captured_engine, tokens, args, device)
        rows.append(row)
        c, e = row.captured, row.engine_captured
        captured = (
            f"{c.tokens_per_s:.1f} | {c.tokens_per_s / row.generate_tps:.2f} | {c.tokens_per_s / row.engine_tps:.2f} | "
            f"{c.eager_launches} / {c.launches} | {c.eager_step_host_ms:.2f} / {c.step_host_ms:.2f} | {row.same_tokens} | "
            f"{_margin(row.captured_margin)}"
            if c is not None else "- | - | - | - | - | - | -"
        )
        through = (
            f"{e.tokens_per_s:.1f} | {e.tokens_per_s / row.generate_tps:.2f} | {e.write_back_ms:.1f} | {e.flush_ms:.0f} | "
            f"{e.copy_gb_per_s:.1f} | {e.found_share:.3f} | {e.drafted_share:.2f} | "
            f"{e.tokens_per_step:.2f} | {e.captured_steps} | {row.engine_same_tokens} | {_margin(row.engine_margin)}"
            if e is not None else "- | - | - | - | - | - | - | - | - | - | -"
        )
        print(f"| {row.prompt_tokens} | {row.generate_tps:.1f} | {row.engine_tps:.1f} | {captured} | {through} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Llama-3.1-8B", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (CPU smoke runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lengths", default="2048,4096,8192,16384", help="prompt tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--doc-tokens", type=int, default=512, help="largest document (RAG splitter piece), tokens")
    parser.add_argument(
        "--doc-chars", type=int, default=None, help="cut documents into pieces of at most this many characters instead"
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="ROWS",
        help="after the table, profile one repair call at the longest length and print this many rows",
    )
    parser.add_argument(
        "--tokenizer", default="embedded", help="embedded (SmolLM2's), tiny (the tests'), or a folder holding a tokenizer"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--attention", default="auto", choices=["auto", *BACKENDS], help="sparse attention backend (auto: per device)"
    )
    parser.add_argument(
        "--captured", action="store_true",
        help="after the table, a decode table: model.generate, the engine's eager steps and captured steps (compiled "
        "graphs; CUDA graphs on CUDA) in the same run",
    )
    parser.add_argument(
        "--engine-captured", action="store_true",
        help="a column of the decode table: the engine's own generate on an engine built with captured steps (drafting on)",
    )
    parser.add_argument(
        "--captured-buckets", default="1,2,4,8,16", help="token buckets of --engine-captured's steps (each is compiled at load)"
    )
    parser.add_argument(
        "--engine-defaults", action="store_true",
        help="--engine-captured's engine with every setting at its default (pool and device tier from free memory, "
        "buckets built in the background and waited for)",
    )
    parser.add_argument(
        "--captured-prefill", default="", metavar="BUCKETS",
        help="the TTFT table's engine runs its prefill passes captured, in these token buckets (e.g. 64,256,1024,4096)",
    )
    parser.add_argument("--decode-only", action="store_true", help="only the decode table (no TTFT table)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = build_model(args.shape, args.layers, device, dtype)
    tokenizer = load_tokenizer(args.tokenizer)
    layers = model.config.num_hidden_layers
    # The TTFT table's engine decodes eagerly: prefill is the same either way, and the decode
    # table measures captured steps apart (one compile instead of every bucket's at load).
    # With --captured-prefill its prefill passes run captured (one decode bucket: decoding is
    # the decode table's business).
    captured = {"captured_steps": "off"}
    if args.captured_prefill:
        captured = dict(
            captured_steps="on", captured_token_buckets=(1,), captured_pool_bytes=pool_bytes(model, lengths, args.decode_tokens),
            captured_prefill_buckets=tuple(int(b) for b in args.captured_prefill.split(",")),
        )
    engine = KVBoost.from_model(
        model, tokenizer, show_progress=False, chunk_size=args.chunk_size,
        max_cache_bytes=64 * 1024**3, check_layer=min(2, layers - 1), **captured,
    )
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    backend = default_backend(device) if args.attention == "auto" else args.attention
    print(
        f"shape={args.shape} layers={layers} dtype={args.dtype} device={device} ({machine}); random weights; "
        f"attention={backend}; median of {args.repeats}; decode {args.decode_tokens} tokens"
    )
    with use_backend(backend):
        if args.decode_only:
            return _decode_table(engine, lengths, args, device)
        timer = ForwardTimer(model, device, (internals(engine).captured_prefill, internals(engine).captured_probe))
        rows = _table(engine, timer, lengths, args, device)
        timer.remove()
        if args.captured or args.engine_captured:
            _decode_table(engine, lengths, args, device)
        return rows


def _table(engine: KVBoost, timer: ForwardTimer, lengths: list[int], args, device: torch.device) -> list[Row]:
    measure(engine, timer, min(lengths[0], 512), args, device)  # warm-up: kernels, compilation
    settings = engine.settings
    repair = f"{settings.recompute_strategy} {settings.recompute_ratio:.0%}" if settings.recompute_ratio != "auto" else "auto"
    print(
        f"| prompt tokens | documents | full prefill SDPA ms | prefix repeat ms | x | {repair} ms | x | "
        "tokenize ms | overhead prefix / repair ms | copies prefix / repair | launches prefix / repair | "
        "syncs prefix / repair | memcpys prefix / repair | host reads prefix / repair | decode tok/s engine | "
        "model.generate | engine / generate | repair stages ms (find/tokenize/plan/lookup/stitch/probe/select/blend) |"
    )
    print("|---" * 18 + "|")
    rows = []
    for tokens in lengths:
        row = measure(engine, timer, tokens, args, device)
        rows.append(row)
        p, b = row.prefix_ops, row.blend_ops
        print(
            f"| {row.prompt_tokens} | {row.documents} | {row.full_ms:.1f} | {row.prefix_ms:.1f} | "
            f"{row.full_ms / row.prefix_ms:.1f} | {row.blend_ms:.1f} | {row.full_ms / row.blend_ms:.1f} | "
            f"{row.tokenize_ms:.1f} | {row.prefix_overhead_ms:.1f} / {row.blend_overhead_ms:.1f} | "
            f"{p.copies} / {b.copies} | {p.launches} / {b.launches} | {p.syncs} / {b.syncs} | "
            f"{p.memcpys} / {b.memcpys} | {p.host_reads} / {b.host_reads} | "
            f"{row.engine_tps:.1f} | {row.generate_tps:.1f} | {row.engine_tps / row.generate_tps:.2f} | "
            f"{'/'.join(f'{row.stages.get(name, 0.0):.1f}' for name in STAGES)} |",
            flush=True,
        )
    if args.profile:
        profile_one_call(engine, lengths[-1], args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"compiled graphs (torch.compile, FlexAttention) over the whole run: {graphs}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
