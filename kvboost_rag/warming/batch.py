"""Warming many documents at once: groups of documents whose prefills go to the engine loop
together.

A one-by-one warm prefills ``document context + document`` on top of the context's stored
K/V and stores the document's chunks. Several documents' prefills handed to the engine loop
together share its steps: the loop packs their passes (and the running answers' next tokens)
into one forward pass each step (:mod:`kvboost_rag.hf.packed`), each document over its own
K/V, so each document's K/V is the one a one-by-one warm computes (to float rounding: the
matrix shapes differ). :func:`batches` cuts the documents into groups of at most
``warm_batch_tokens`` tokens: the K/V buffers of one group are held at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvboost_rag.request.plan import PromptPlan


@dataclass(frozen=True)
class WarmJob:
    """One document to compute: its plan (document context, then the document's tokens).

    Attributes:
        index: Position of the document in the caller's list.
        plan: The plan a one-by-one warm builds (the context as the lookup limit).
    """

    index: int
    plan: PromptPlan


def batches(jobs: Sequence[WarmJob], max_tokens: int) -> list[list[WarmJob]]:
    """Group jobs, shortest first, so that a group's tokens stay within ``max_tokens``
    (``0``: one job per group). A job longer than ``max_tokens`` gets a group of its own."""
    ordered = sorted(jobs, key=lambda job: job.plan.num_tokens)
    groups: list[list[WarmJob]] = []
    total = 0
    for job in ordered:
        if groups and max_tokens and total + job.plan.num_tokens <= max_tokens:
            groups[-1].append(job)
            total += job.plan.num_tokens
        else:
            groups.append([job])
            total = job.plan.num_tokens
    return groups
