"""Comparing the reuse path with full prefill: first-token KL, top-1 and output agreement."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost_rag.results import CorrectnessReport, GenerationResult, PromptCheck


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) between the next-token distributions of two logit vectors."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    return float(torch.sum(ref.exp() * (ref - other)).clamp_min(0.0))


def compare_runs(pairs: Sequence[tuple[GenerationResult, GenerationResult]], kl_tolerance: float) -> CorrectnessReport:
    """Build a report from ``(full prefill, reuse)`` result pairs that carry first-token logits."""
    checks = []
    for full, reused in pairs:
        if full.first_token_logits is None or reused.first_token_logits is None:
            raise ValueError("both runs need return_logits=True")
        checks.append(
            PromptCheck(
                prompt_tokens=full.prompt_tokens,
                kv_reuse_ratio=reused.kv_reuse_ratio,
                first_token_kl=first_token_kl(full.first_token_logits, reused.first_token_logits),
                top1_agrees=int(full.first_token_logits.argmax()) == int(reused.first_token_logits.argmax()),
                max_logit_diff=float((full.first_token_logits - reused.first_token_logits).abs().max()),
                outputs_identical=full.token_ids == reused.token_ids,
                reuse_ttft_ms=reused.ttft_ms,
                full_ttft_ms=full.ttft_ms,
            )
        )
    mean_kl = sum(c.first_token_kl for c in checks) / len(checks)
    top1 = sum(c.top1_agrees for c in checks) / len(checks)
    return CorrectnessReport(
        checks=checks,
        mean_first_token_kl=mean_kl,
        top1_agreement=top1,
        output_agreement=sum(c.outputs_identical for c in checks) / len(checks),
        passed=top1 == 1.0 and mean_kl <= kl_tolerance,
        kl_tolerance=kl_tolerance,
    )
