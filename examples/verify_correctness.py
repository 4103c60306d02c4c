"""Check the reuse path against full prefill on your own prompts.

Run: ``python examples/verify_correctness.py [prompts.json]`` where the optional file holds a
JSON object ``{"system": "...", "documents": ["..."], "prompts": ["..."]}``; without a file,
prompts are built from the Python reference docs. The documents are warmed first, then each
prompt runs with reuse and with full prefill. Exits with status 1 when the report fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents

DEFAULT_SYSTEM = "You are a helpful assistant. Answer using the documents below."


def default_case(count: int, per_prompt: int) -> dict:
    """System prompt, documents and shuffled prompts from the Python reference docs."""
    docs = python_reference_documents(max_chars=700)[20 : 20 + 2 * per_prompt]
    rng = random.Random(1)
    prompts = [
        DEFAULT_SYSTEM + "\n\n" + "\n\n".join(rng.sample(docs, per_prompt)) + f"\n\nQuestion {i}: summarize the rules.\nAnswer:"
        for i in range(count)
    ]
    return {"system": DEFAULT_SYSTEM, "documents": docs, "prompts": prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", type=Path, help="JSON file with system, documents, prompts")
    parser.add_argument("--prompts", type=int, default=3, help="prompts to build without a file")
    parser.add_argument("--docs-per-prompt", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--kl-tolerance", type=float, default=0.05)
    parser.add_argument("--recompute-ratio", type=float, default=0.15)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    case = json.loads(args.case.read_text()) if args.case else default_case(args.prompts, args.docs_per_prompt)
    system = case.get("system") or ""
    engine = KVBoost.from_pretrained(warm_prefix=(system + "\n\n") if system else None, recompute_ratio=args.recompute_ratio)
    if system:
        engine.warm(system)
    engine.warm_documents(case.get("documents", []))
    report = engine.verify_correctness(case["prompts"], max_new_tokens=args.max_new_tokens, kl_tolerance=args.kl_tolerance)

    print("| prompt | tokens | reused | first-token KL | top-1 | same output | TTFT reuse / full ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, check in enumerate(report.checks):
        print(
            f"| {i} | {check.prompt_tokens} | {check.kv_reuse_ratio:.0%} | {check.first_token_kl:.4f} | "
            f"{'yes' if check.top1_agrees else 'no'} | {'yes' if check.outputs_identical else 'no'} | "
            f"{check.reuse_ttft_ms:.0f} / {check.full_ttft_ms:.0f} |"
        )
    print(
        f"\nmean KL {report.mean_first_token_kl:.4f} (tolerance {report.kl_tolerance}), "
        f"top-1 agreement {report.top1_agreement:.0%}, identical outputs {report.output_agreement:.0%}: "
        f"{'PASSED' if report.passed else 'FAILED'}"
    )
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
