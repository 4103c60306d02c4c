"""Forced tool calls and structured outputs at small token budgets, on the embedded model.

For each budget (``max_new_tokens``) and question this decodes, greedily and through the same
rendering the integrations use (``kvboost_rag.decode.tool_calls.render_chat``):

- a forced call of a tool with two free string arguments (``tool_choice`` = its name), read
  back with :func:`~kvboost_rag.decode.tool_calls.parse_tool_calls`;
- a structured output of a three-field object (two strings and an integer), read back with
  pydantic.

It counts outputs that parse and validate and reports decode milliseconds per token (constrained,
and unconstrained answers of 48 tokens). Budgets below the constraint's minimum are reported as
refused (``InvalidInputError`` before decoding). Where the engine closes outputs, the valid forced
calls are replayed through the constraint's guide, compiled without and with the budget, to
time what masking and advancing cost per token, closing included (the decode step left out).

Run: ``python bench/closing_bench.py [--threads 1] [--budgets 24,32,48,256] [--json out.json]``.
The same script on an engine without closing (before it) counts the outputs the budget cut.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from kvboost_rag import InvalidInputError, KVBoost
from kvboost_rag.decode.tool_calls import call_format, parse_tool_calls, render_chat
from kvboost_rag.dev.internals import internals

QUESTIONS = [
    "Look up the json module.",
    "Find what the with statement does.",
    "Search for how to sort a list of tuples by the second item.",
    "Which exceptions does int() raise on bad input?",
]

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Search the Python documentation.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for."},
                "section": {"type": "string", "description": "Part of the docs: library, reference or tutorial."},
            },
            "required": ["query", "section"],
        },
    },
}


class Answer(BaseModel):
    """A structured answer."""

    topic: str
    answer: str
    confidence: int


#: What ``with_structured_output(Answer)`` asks for.
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": Answer.model_json_schema()}}


def forced_call(engine: KVBoost, question: str, budget: int) -> tuple[str, Any]:
    """``("ok" | "invalid" | "refused", result)`` of a forced ``lookup`` call."""
    fmt = call_format([LOOKUP], "lookup")
    prompt = render_chat(engine, [{"role": "user", "content": question}], fmt)
    try:
        result = engine.generate(prompt, max_new_tokens=budget, constraint=fmt.constraint)
    except InvalidInputError:
        return "refused", None
    calls = parse_tool_calls(result.output_text, result.finish_reason).valid_calls
    ok = len(calls) == 1 and set(calls[0].arguments or {}) == {"query", "section"}
    return ("ok" if ok else "invalid"), result


def structured(engine: KVBoost, question: str, budget: int) -> tuple[str, Any]:
    """``("ok" | "invalid" | "refused", result)`` of a structured ``Answer``."""
    fmt = call_format(response_format=ANSWER_FORMAT)
    prompt = render_chat(engine, [{"role": "user", "content": question}], fmt)
    try:
        result = engine.generate(prompt, max_new_tokens=budget, constraint=fmt.constraint)
    except InvalidInputError:
        return "refused", None
    try:
        Answer.model_validate_json(result.output_text)
    except ValidationError:
        return "invalid", result
    return "ok", result


def ms_per_token(results: list[Any]) -> float:
    """Median decode milliseconds per token after the first."""
    rates = [(r.total_ms - r.ttft_ms) / (r.generated_tokens - 1) for r in results if r and r.generated_tokens > 1]
    return statistics.median(rates) if rates else float("nan")


def guide_us_per_token(engine: KVBoost, fmt: Any, runs: list[tuple[str, Any]], budget: int | None) -> float:
    """Median microseconds per token to mask a logits row and advance the constraint's guide,
    replaying the valid outputs of ``runs`` (``budget``: compiled to close within it; ``None``:
    without closing). The decode step's own cost is left out."""
    logits = torch.zeros(engine.model.config.vocab_size)
    times = []
    for status, result in runs:
        if status != "ok":
            continue
        guide = internals(engine).constraints.compile(fmt.constraint, budget)
        for token in result.token_ids:
            start = time.perf_counter()
            guide.mask(logits)
            guide.advance(token)
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times) if times else float("nan")


def minimum(engine: KVBoost, fmt: Any) -> str:
    """The constraint's minimum budget (``-`` where the engine has no closing)."""
    find = getattr(engine, "min_new_tokens", None)
    return "-" if find is None else str(find(fmt.constraint))


def cell(runs: list[tuple[str, Any]]) -> str:
    """``valid/total``, or ``refused`` when every run was refused before decoding."""
    if all(status == "refused" for status, _ in runs):
        return "refused"
    return f"{sum(status == 'ok' for status, _ in runs)}/{len(runs)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--budgets", default="16,24,32,48,64,256", help="max_new_tokens values, comma-separated")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="use the first N questions")
    parser.add_argument("--json", type=Path, help="write every output (status and text) to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(args.threads)
    engine = KVBoost.from_pretrained(show_progress=False)
    questions = QUESTIONS[: args.questions]
    budgets = [int(b) for b in args.budgets.split(",")]
    call_fmt = call_format([LOOKUP], "lookup")
    answer_fmt = call_format(response_format=ANSWER_FORMAT)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}, model {engine.model_name}")
    print(f"minimum budget: forced call {minimum(engine, call_fmt)}, structured output {minimum(engine, answer_fmt)}")
    closes = hasattr(engine, "min_new_tokens")
    print("\n| budget | forced call valid | structured valid | ms/token (call) | ms/token (structured) |")
    print("|---|---|---|---|---|")
    rows = []
    guide_costs: list[tuple[int, float, float]] = []
    for budget in budgets:
        calls = [forced_call(engine, q, budget) for q in questions]
        outs = [structured(engine, q, budget) for q in questions]
        print(
            f"| {budget} | {cell(calls)} | {cell(outs)} | {ms_per_token([r for _, r in calls]):.1f} | "
            f"{ms_per_token([r for _, r in outs]):.1f} |",
            flush=True,
        )
        if closes:
            guide_costs.append((budget, guide_us_per_token(engine, call_fmt, calls, None),
                                guide_us_per_token(engine, call_fmt, calls, budget)))
        rows.append({
            "budget": budget,
            "calls": [(status, r.output_text if r else None) for status, r in calls],
            "structured": [(status, r.output_text if r else None) for status, r in outs],
        })
    free = [
        engine.generate(render_chat(engine, [{"role": "user", "content": q}], call_format()), max_new_tokens=48)
        for q in questions
    ]
    print(f"\nunconstrained decode: {ms_per_token(free):.1f} ms/token (48-token answers)")
    if guide_costs:
        print("\nForced calls replayed through the guide (mask + advance, median µs per token):\n")
        print("| budget | without closing | closing within the budget |")
        print("|---|---|---|")
        for budget, plain, closing in guide_costs:
            print(f"| {budget} | {plain:.0f} | {closing:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
