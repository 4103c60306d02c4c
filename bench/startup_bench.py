"""Start-up with default settings: from building the model to the first token, and to every
captured step ready.

One process: the model (random weights at a named shape, as ``gpu_bench.py`` builds it; what
``from_pretrained`` would load), an engine with every setting at its default (on CUDA: captured
steps built in the background, their compiled code kept under ``KVBOOST_RAG_HOME``), one
streamed request of about ``--tokens`` prompt tokens, then the wait for every captured step and
a second request. It prints one line of seconds since the model build began: engine built,
first token of the first request, steps ready, and the compiled graphs torch found in its
on-disk cache against those it compiled.

Run it twice with the same ``KVBOOST_RAG_HOME`` (``scripts/gpu_check.sh`` does): the first run
is a machine that never compiled (its first token must not wait for the compiles), the second a
machine that compiled before (everything ready within seconds).

``python bench/startup_bench.py --device cuda --shape Llama-3.1-8B --tokens 8192``; a CPU dry
run: ``--device cpu --dtype float32 --shape tiny --tokenizer tiny --tokens 512 --captured on``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import SHAPES, build_model, build_prompt, load_tokenizer, sync  # noqa: E402

from kvboost_rag import KVBoost  # noqa: E402
from kvboost_rag.hf.captured.graph import compile_cache_counts  # noqa: E402


def _first_token(engine: KVBoost, prompt: str, tokens: int, device: torch.device) -> tuple[float, float, int]:
    """``(perf_counter at the first piece, at the last, captured steps run)`` of one streamed call."""
    before = engine.captured_steps_run or 0
    stream = engine.stream(prompt, max_new_tokens=tokens)
    first = last = None
    for _ in stream:
        last = time.perf_counter()
        first = first or last
    sync(device)
    return first or time.perf_counter(), last or time.perf_counter(), (engine.captured_steps_run or 0) - before


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Llama-3.1-8B", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokenizer", default="embedded")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens of the requests")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--captured", default="auto", choices=["auto", "on", "off"], help="captured_steps (default: auto)")
    parser.add_argument("--ready-limit", type=float, default=None, help="seconds to wait for every captured step at most")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    started = time.perf_counter()
    model = build_model(args.shape, None, device, dtype)
    tokenizer = load_tokenizer(args.tokenizer)
    sync(device)
    model_s = time.perf_counter() - started
    engine = KVBoost.from_model(model, tokenizer, show_progress=False, captured_steps=args.captured)
    engine_s = time.perf_counter() - started
    prompt, _, _ = build_prompt(tokenizer, args.tokens, seed=args.tokens)
    first, _, first_captured = _first_token(engine, prompt, args.new_tokens, device)
    ready = engine.wait_for_captured_steps(args.ready_limit)
    ready_s = time.perf_counter() - started
    hits, misses = compile_cache_counts()
    prompt2, _, _ = build_prompt(tokenizer, args.tokens, seed=args.tokens + 1)
    begun = time.perf_counter()
    first2, last2, captured2 = _first_token(engine, prompt2, args.new_tokens, device)
    rate = (args.new_tokens - 1) / (last2 - first2) if last2 > first2 else float("nan")
    print(
        "| model built s | engine built s | first token s | first call's captured steps | steps ready s | "
        "compile cache found / compiled | second call: first token s, decode tok/s, captured steps |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {model_s:.1f} | {engine_s:.1f} | {first - started:.1f} | {first_captured} | "
        f"{ready_s:.1f}{'' if ready else ' (not all ready)'} | {hits} / {misses} | "
        f"{first2 - begun:.2f}, {rate:.1f}, {captured2} |"
    )


if __name__ == "__main__":
    main()
