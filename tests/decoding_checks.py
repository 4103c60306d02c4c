"""Reuse paths against full prefill, step by step, to the rounding of the dtype.

Greedy tokens alone are not a portable check: where full prefill's two best logits are
closer than the dtype's rounding, another kernel path (AVX2, AVX-512, AVX512-BF16, AMX, CUDA)
can pick either, with or without reuse. So a reuse path is checked two ways:

- teacher-forced: decoding is forced along full prefill's greedy tokens (an output constraint
  of those token ids), and the logits of every step must match full prefill's to ``atol``;
- free: its greedy tokens must equal full prefill's up to the first step whose top-1 margin
  is within rounding (``2 * atol``: each of the two logits may move by ``atol``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvboost_rag import KVBoost
from kvboost_rag.decode.constrained import OutputConstraint
from kvboost_rag.decode.sampling import eos_token_ids
from kvboost_rag.results import GenerationResult


def forcing(tokens: list[int]) -> OutputConstraint:
    """An output constraint that admits exactly ``tokens``, in order."""
    return OutputConstraint(grammar="start: " + " ".join(f"<[{t}]>" for t in tokens))


def margins(step_logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit of each step."""
    top = step_logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@dataclass
class DecodingCheck:
    """What :func:`check_against_full_prefill` compared.

    Attributes:
        forced: The reuse path decoded along full prefill's tokens.
        free: The reuse path decoded freely (greedy).
        max_step_diff: Largest logit difference over every forced step.
        steps_compared: Greedy tokens compared (those before the first near tie).
    """

    forced: GenerationResult
    free: GenerationResult
    max_step_diff: float
    steps_compared: int


def check_against_full_prefill(
    engine: KVBoost, prompt: str, full: GenerationResult, atol: float | None = None, rtol: float = 0.0, **options: Any
) -> DecodingCheck:
    """Assert the reuse path decodes like ``full`` (a ``reuse=False`` run with
    ``return_logits=True``) to ``atol + rtol * max|logit|`` at every step.

    Args:
        engine: The engine (documents or beginnings warmed as the test needs).
        prompt: The prompt ``full`` answered.
        full: Full prefill's greedy run.
        atol: Absolute logit tolerance.
        rtol: Tolerance relative to the largest logit magnitude of each step.
        options: More generation options for both reuse runs.
    """
    assert full.step_logits is not None, "full prefill needs return_logits=True"
    steps = full.step_logits.shape[0]
    chosen = full.step_logits.argmax(dim=-1).tolist()
    eos = eos_token_ids(engine.model, engine.tokenizer)
    forced_tokens = chosen[: next((i for i, t in enumerate(chosen) if t in eos), steps)]
    tolerance = [(atol or 0.0) + rtol * float(row.abs().max()) for row in full.step_logits.float()]
    forced = engine.generate(
        prompt, max_new_tokens=len(forced_tokens), return_logits=True, constraint=forcing(forced_tokens), **options
    )
    assert forced.token_ids == forced_tokens
    assert forced.step_logits is not None and forced.step_logits.shape[0] == len(forced_tokens)
    diffs = (forced.step_logits.float() - full.step_logits[: len(forced_tokens)].float()).abs().amax(dim=-1).tolist()
    for step, (diff, tol) in enumerate(zip(diffs, tolerance)):
        assert diff <= tol, f"step {step}: logits differ by {diff:.3g} (tolerance {tol:.3g})"
    free = engine.generate(prompt, max_new_tokens=steps, return_logits=True, **options)
    compared = 0
    for step, margin in enumerate(margins(full.step_logits)):
        if step >= len(full.token_ids) or margin <= 2 * tolerance[step]:
            break  # a near tie: rounding on another kernel path may pick either token
        assert free.token_ids[step] == full.token_ids[step], (
            f"step {step}: token {free.token_ids[step]} instead of {full.token_ids[step]} "
            f"(full prefill's top-1 margin {margin:.3g} > 2 x tolerance {tolerance[step]:.3g})"
        )
        compared += 1
    return DecodingCheck(forced, free, max(diffs, default=0.0), compared)
