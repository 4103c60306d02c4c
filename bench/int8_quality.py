"""What decoding on int8 weights costs in quality: greedy answers and next-token KL against the model's own.

For each chat RAG prompt of ``bench/decode_bench.py`` (the same prompts: a system turn, ``--docs``
reference documents in a new order, a question), the prompt is prefilled once on the model's own
weights (as the engine does: prefill never reads int8), then, from copies of that cache:

- the model's own greedy answer of ``--new-tokens`` tokens, one-token steps on its own weights,
  and each step's logits;
- the greedy answer with the decode steps on the int8 copy (:mod:`kvboost_rag.decode_weights.int8_rows`,
  through the engine's small-row layer routing, :mod:`kvboost_rag.decode_weights.small_rows`);
- the int8 logits of the model's own answer, teacher-forced (one pass of its tokens on int8):
  the per-step next-token KL(own || int8).

Per prompt: whether the int8 answer equals the own one up to the own answer's first near tie
(a decode step where its top-1 logit leads the top-2 by less than ``--tie-margin``; the first
token is prefill's, the same in both), the step of the
first difference, and the median and largest per-step KL. The summary: the share of prompts that
agree up to the first near tie (the bar for int8 by default: >= 95%), the share equal over the
whole answer, and the median over all steps of all prompts of the per-step KL (bar: <= 0.001).

Run: ``python -u bench/int8_quality.py --threads 2`` (``--model PATH``, ``--prompts 24``,
``--first 0`` to run a slice of the prompts, ``--jsonl FILE`` to append per-prompt results and
``--summarize FILE`` to print the summary of such a file).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_bench import build_prompts  # noqa: E402


def _step(model, token: int, cache, position: int) -> torch.Tensor:
    out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True, cache_position=torch.tensor([position]))
    return out.logits[0, -1].float()


@torch.inference_mode()
def compare(model, linears, ids: list[int], new_tokens: int) -> dict:
    """One prompt: the own and int8 greedy answers, and the teacher-forced per-step KL."""
    out = model(torch.tensor([ids]), use_cache=True)
    prefilled, first_logits = out.past_key_values, out.logits[0, -1].float()
    n = len(ids)
    own_tokens, own_logits = [int(first_logits.argmax())], [first_logits]
    cache = copy.deepcopy(prefilled)
    for step in range(1, new_tokens):
        logits = _step(model, own_tokens[-1], cache, n + step - 1)
        own_logits.append(logits)
        own_tokens.append(int(logits.argmax()))
    int8_tokens = [own_tokens[0]]  # the first token comes from prefill, on the model's own weights
    cache = copy.deepcopy(prefilled)
    with linears.active():
        for step in range(1, new_tokens):
            int8_tokens.append(int(_step(model, int8_tokens[-1], cache, n + step - 1).argmax()))
        forced = model(
            torch.tensor([own_tokens[:-1]]), past_key_values=copy.deepcopy(prefilled), use_cache=True,
            cache_position=torch.arange(n, n + new_tokens - 1),
        ).logits[0].float()
    own = torch.stack(own_logits[1:]).log_softmax(-1)
    kl = (own.exp() * (own - forced.log_softmax(-1))).sum(-1).clamp_min(0).tolist()
    top2 = torch.stack(own_logits).topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    first_diff = next((i for i, (a, b) in enumerate(zip(own_tokens, int8_tokens)) if a != b), None)
    return {"tokens": new_tokens, "first_diff": first_diff, "margins": margins, "kl": kl}


def first_tie(row: dict, tie_margin: float) -> int:
    """The first decode step (the first token comes from prefill, the same in both) at which
    the own answer's top-1 logit leads by less than ``tie_margin``; the answer's length if none."""
    return next((i for i, m in enumerate(row["margins"]) if i >= 1 and m < tie_margin), row["tokens"])


def summarize(rows: list[dict], tie_margin: float) -> list[str]:
    agree = whole = 0
    for row in rows:
        tie = first_tie(row, tie_margin)
        agree += row["first_diff"] is None or row["first_diff"] >= tie
        whole += row["first_diff"] is None
    steps = [k for row in rows for k in row["kl"]]
    return [
        f"{len(rows)} prompts: answers on the decode weights equal the own ones up to the first near tie (top-1 margin < {tie_margin}) "
        f"on {agree} ({agree / len(rows):.1%}), over the whole answer on {whole} ({whole / len(rows):.1%}); "
        f"per-step next-token KL(own || decode weights) over {len(steps)} steps: median {statistics.median(steps):.2e}, "
        f"mean {statistics.fmean(steps):.2e}, p90 {sorted(steps)[int(0.9 * len(steps))]:.2e}, max {max(steps):.2e}"
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--first", type=int, default=0, help="first prompt to run (a slice of the same prompts)")
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-chars", type=int, default=1600)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--decode-weights", choices=("int8", "stored", "auto"), default="int8",
        help="what decode reads: int8 (an int8 copy, layers stored as 4-bit runs read as stored), stored (those runs, "
        "the model's own weights elsewhere) or auto (the engine's default)",
    )
    parser.add_argument("--tie-margin", type=float, default=0.5, help="top-1 minus top-2 logit below which a step is a near tie")
    parser.add_argument("--jsonl", type=Path, default=None, help="append per-prompt results here")
    parser.add_argument("--summarize", type=Path, default=None, help="print the summary of a --jsonl file and exit")
    args = parser.parse_args(argv)
    if args.summarize is not None:
        rows = [json.loads(line) for line in args.summarize.read_text().splitlines() if line.strip()]
        print("\n".join(summarize(rows, args.tie_margin)))
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_rag.default_model import default_model_dir
    from kvboost_rag.decode_weights.small_rows import choose_kernel

    torch.set_num_threads(args.threads)
    folder = Path(args.model) if args.model else default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    linears = choose_kernel(model, "off", 0, decode_weights=args.decode_weights)
    assert linears.routed, f"decode_weights={args.decode_weights} reads the model's own weights on this machine"
    prompts, _, _ = build_prompts(tokenizer, args.first + args.prompts, args.docs, args.doc_chars, False, args.seed)
    print(f"int8_quality: {folder.name}, {args.threads} torch threads, torch {torch.__version__}, {args.new_tokens} new tokens, "
          f"prompts {args.first}-{args.first + args.prompts - 1}, decode_weights={args.decode_weights}: "
          f"{len(linears.four_bit)} layers as stored 4-bit runs, the others {linears.kernel}, copies {linears.copy_bytes / 1e6:.0f} MB", flush=True)
    rows = []
    for i, (kind, prompt) in enumerate(prompts[args.first :], start=args.first):
        start = time.perf_counter()
        row = {"prompt": i, "kind": kind, "model": folder.name, **compare(model, linears, tokenizer(prompt).input_ids, args.new_tokens)}
        rows.append(row)
        tie = first_tie(row, args.tie_margin)
        print(f"prompt {i} ({kind}): first difference {row['first_diff']}, first near tie {tie}, KL median "
              f"{statistics.median(row['kl']):.2e} max {max(row['kl']):.2e} ({time.perf_counter() - start:.0f} s)", flush=True)
        if args.jsonl is not None:
            with args.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print("\n".join(summarize(rows, args.tie_margin)))


if __name__ == "__main__":
    main()
