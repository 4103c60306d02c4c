"""Warming many documents through the model a batch at a time.

A one-by-one warm prefills ``document context + document`` on top of the context's stored
K/V and stores the document's chunks. :class:`BatchWarmer` does the same for several
documents in one forward pass: the context's K/V is repeated once per row, the documents are
right-padded to one length and run at the positions a one-by-one warm gives them. Attention is
causal, so a document's tokens never see the padding after them, and each document's K/V is
the one a one-by-one warm computes (to float rounding: the matrix shapes differ). The pass runs
in chunks of columns that pause between them, as a prompt's prefill does. Each row is
then handed to :meth:`~kvboost_rag.cache.manager.CacheManager.write_back` with the document's
own plan, exactly as a one-by-one warm stores it.

Models whose layers do not all attend globally (sliding windows, interleaved local layers)
are warmed one by one: their cache layers keep per-layer windows a plain batch would ignore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvboost_rag.cache.manager import CacheManager
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.passes import WHOLE, Chunking, batch_pass
from kvboost_rag.prefill.outcome import PrefillOutcome
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


def batchable(adapter: ModelAdapter) -> bool:
    """Whether every layer of the model attends globally (so rows may share one plain batch)."""
    return adapter.windows.all_global


def batches(jobs: Sequence[WarmJob], max_tokens: int) -> list[list[WarmJob]]:
    """Group jobs, shortest first, so that rows x padded length stays within ``max_tokens``.

    A job longer than ``max_tokens`` gets a batch of its own.
    """
    ordered = sorted(jobs, key=lambda job: job.plan.num_tokens)
    groups: list[list[WarmJob]] = []
    for job in ordered:
        if groups and (len(groups[-1]) + 1) * job.plan.num_tokens <= max_tokens:
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


class BatchWarmer:
    """Computes and stores several documents behind the same document context per forward.

    Args:
        adapter: The model adapter.
        cache: The cache manager (prefix lookup of the context, write-back of each document).
        chunking: How the pass is cut (chunks of columns) and where it pauses for decode
            steps, read at every run (the prefiller's).
    """

    def __init__(
        self, adapter: ModelAdapter, cache: CacheManager, chunking: Callable[[], Chunking] = lambda: WHOLE
    ) -> None:
        self.adapter = adapter
        self.cache = cache
        self.chunking = chunking

    @torch.inference_mode()
    def run(self, jobs: Sequence[WarmJob]) -> dict[int, int] | None:
        """Compute one batch of documents and store their chunks.

        The context's K/V is copied, and each document stored, a row at a time, with a pause
        between two rows (as between two chunks of the pass): open streams' decode steps may
        run there.

        Args:
            jobs: Documents planned behind the same document context.

        Returns:
            New document tokens stored, by job index; ``None`` when the context is not stored
            whole or the jobs' contexts differ (the caller warms those documents one by one).
        """
        plan0 = jobs[0].plan
        pieces = self.cache.match_prefix(plan0)
        h = sum(piece.length for piece in pieces)
        lead = plan0.tokens.ids[:h]
        if h != plan0.lookup_limit or any(job.plan.lookup_limit != h or job.plan.tokens.ids[:h] != lead for job in jobs):
            return None
        chunking = self.chunking()
        rows = len(jobs)
        width = max(job.plan.num_tokens for job in jobs) - h
        keys, values = self.adapter.batch_buffers(rows, h + width)
        for r in range(rows):
            if r:
                chunking.pause()
            for piece in pieces:
                end = piece.start + piece.length
                keys[:, r, :, piece.start : end] = piece.block.keys[:, :, : piece.length]
                values[:, r, :, piece.start : end] = piece.block.values[:, :, : piece.length]
        input_ids = torch.zeros((rows, width), dtype=torch.long)
        for r, job in enumerate(jobs):
            ids = job.plan.tokens.ids[h:]
            input_ids[r, : len(ids)] = torch.tensor(ids)
            input_ids[r, len(ids) :] = ids[-1]  # padding after the document: never attended to
        positions = torch.arange(h, h + width).expand(rows, width)
        batch_pass(self.adapter, chunking, input_ids, positions, self.adapter.batch_cache(keys, values, h))
        return self._store(jobs, pieces, keys, values, chunking)

    def _store(
        self, jobs: Sequence[WarmJob], pieces: Sequence, keys: torch.Tensor, values: torch.Tensor, chunking: Chunking
    ) -> dict[int, int]:
        """Write back each row's document (new tokens stored, by job index), pausing before each."""
        h = sum(piece.length for piece in pieces)
        stored: dict[int, int] = {}
        for r, job in enumerate(jobs):
            chunking.pause()
            n = job.plan.num_tokens
            outcome = PrefillOutcome(
                logits=None,
                cache=None,
                keys=keys[:, r, :, :n],
                values=values[:, r, :, :n],
                prefix_tokens=h,
                prefix_keys=tuple(piece.key for piece in pieces),
                documents=job.plan.documents_after(h),
                live_tokens=n - h,
                strategy="exact",
            )
            stored[job.index] = self.cache.write_back(job.plan, outcome, store_documents=True)
        return stored
