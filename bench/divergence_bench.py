"""Where a repaired prompt's greedy answer first leaves full prefill's, and how close the call was.

For each prompt (``reuse_bench`` prompts, any corpus, plain or chat): full prefill's greedy
answer, then the repaired one at each ``--rows`` setting; at the first differing token, full
prefill's own margin there (top-1 minus top-2 logit, from one plain forward pass over the prompt
and the answer so far). A small margin means a near tie that only an exact cache keeps; a large
one means the repair left something the answer reads stale.

Run: ``python bench/divergence_bench.py --corpus stdlib --threads 1``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reuse_bench import SYSTEM_PROMPT, apply_settings, build_prompts, first_difference  # noqa: E402

from kvboost_rag import KVBoost  # noqa: E402

DEFAULT_ROWS = '[["attention 10% value", {"recompute_strategy": "attention", "recompute_ratio": 0.10, "probe_weighting": "value"}]]'


@torch.inference_mode()
def margin_at(engine: KVBoost, prompt: str, answer: list[int], step: int) -> tuple[float, int, int]:
    """Full prefill's top-1 minus top-2 logit before ``answer[step]``, and those two tokens."""
    prompt_ids = list(engine.tokenizer(prompt, add_special_tokens=True)["input_ids"])  # as full prefill reads it
    ids = torch.tensor([prompt_ids + answer[:step]])
    logits = engine.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="stdlib")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-chars", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="rows as JSON, as in reuse_bench --rows")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = KVBoost.from_pretrained(show_progress=False)
    render = engine.apply_chat_template if args.chat else None
    beginning = (
        engine.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}], add_generation_prompt=False)
        if args.chat
        else SYSTEM_PROMPT + "\n\n"
    )
    prompts, pool = build_prompts(args.prompts, args.docs, args.doc_chars, args.seed, render, args.corpus)
    engine.warm(beginning)
    engine.warm_documents(pool)
    rows = json.loads(args.rows)
    print("| prompt | row | first difference | full prefill's margin there (logits) | full's token | repaired run's token |")
    print("|---:|---|---:|---:|---|---|")
    for i, (prompt, _, _) in enumerate(prompts):
        full = engine.generate(prompt, max_new_tokens=args.new_tokens, reuse=False)
        for name, settings in rows:
            apply_settings(engine.settings, settings)
            res = engine.generate(prompt, max_new_tokens=args.new_tokens)
            step = first_difference(full.token_ids, res.token_ids)
            if step >= min(len(full.token_ids), len(res.token_ids)):
                print(f"| {i} | {name} | none | - | - | - |")
                continue
            margin, _, _ = margin_at(engine, prompt, full.token_ids, step)
            print(
                f"| {i} | {name} | {step} | {margin:.2f} | {engine.tokenizer.decode([full.token_ids[step]])!r} | "
                f"{engine.tokenizer.decode([res.token_ids[step]])!r} |"
            )


if __name__ == "__main__":
    main()
