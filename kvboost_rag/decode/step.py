"""Decoding several sequences together: per-sequence state and one batched step.

A :class:`DecodeSequence` is one prompt after its prefill: its cache, the position of its
next token, its options, sampler, text assembler and budget. :func:`decode_step` feeds the
pending token of every sequence through the model in one forward pass
(:meth:`~kvboost_rag.hf.adapter.ModelAdapter.forward_ragged`: each sequence at its own
position over its own cache) and hands each sequence its logits. Token choice, EOS, stop
strings and the token budget are per sequence, exactly as when a sequence decodes alone; a
sequence that finished simply is not passed to the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler, next_token
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.caches import ModelCache
from kvboost_rag.request.options import GenerationOptions

FinishReason = Literal["stop", "eos", "length"]


@dataclass
class DecodeSequence:
    """One sequence between its prefill and its last token.

    Attributes:
        cache: Its K/V, holding positions ``0..position - 1``.
        position: Position of the token it feeds next.
        budget: Most tokens it may produce.
        options: Its generation options.
        sampling: Its token choice state (seeded generator, output constraint, tokens so far).
        assembler: Its text so far (stop strings are applied here).
        eos_ids: Tokens that end it.
        token: The token it feeds next (chosen, not fed yet).
        produced: Tokens counted against ``budget``.
        finish_reason: Set once it is done.
        finished_at: ``time.perf_counter()`` when it was done.
        step_logits: The logits of each step, kept on the host when ``options.return_logits``.
        before_first_step: Work on its cache that must run once its first token is chosen and
            before that token is decoded (the lookahead repair); the decode worker runs it
            when the sequence joins, so the first token is already on its way.
    """

    cache: ModelCache
    position: int
    budget: int
    options: GenerationOptions
    sampling: SequenceSampling
    assembler: TextAssembler
    eos_ids: frozenset[int] = frozenset()
    token: int | None = None
    produced: int = 0
    finish_reason: FinishReason | None = None
    finished_at: float | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list)
    before_first_step: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        """Whether it produced its last token."""
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor) -> list[str]:
        """Choose the next token from this step's ``[vocab]`` logits and account for it.

        Returns:
            Text pieces now safe to show (see :meth:`take`).
        """
        if self.options.return_logits:
            self.step_logits.append(logits.detach().to("cpu", copy=True))
        return self.take(next_token(logits, self.options, self.sampling))

    def take(self, token: int) -> list[str]:
        """Account for a newly chosen token.

        Returns:
            Text pieces now safe to show (the rest of the text too when the sequence ends).
        """
        pieces: list[str] = []
        if token in self.eos_ids:
            self.finish_reason = "eos"
        else:
            self.produced += 1
            piece = self.assembler.add(token)
            if piece:
                pieces.append(piece)
            if self.assembler.stopped:
                self.finish_reason = "stop"
            elif self.produced >= self.budget:
                # A constrained output that closed on its last token ended, it was not cut.
                guide = self.sampling.guide
                self.finish_reason = "eos" if guide is not None and guide.finished else "length"
            else:
                self.token = token
        if self.done:
            self.finished_at = time.perf_counter()
            rest = self.assembler.finish()
            if rest:
                pieces.append(rest)
        return pieces


@dataclass
class StepResult:
    """What one step did for one sequence: new text pieces, or the error that ended it."""

    pieces: list[str] = field(default_factory=list)
    error: BaseException | None = None


def decode_step(adapter: ModelAdapter, sequences: Sequence[DecodeSequence]) -> list[StepResult]:
    """Feed every sequence's pending token in one forward pass and choose its next token.

    Args:
        adapter: The model adapter.
        sequences: Sequences not done, each with a pending ``token``.

    Returns:
        One result per sequence, in order. Choosing or detokenizing a token that fails ends
        that sequence only (its ``error``); the others go on.

    Raises:
        Exception: Whatever the forward pass raised (no sequence advanced).
    """
    tokens = torch.tensor([s.token for s in sequences])
    positions = torch.tensor([s.position for s in sequences])
    logits = adapter.forward_ragged(tokens, positions, [s.cache for s in sequences])  # [batch, vocab]
    results: list[StepResult] = []
    for sequence, row in zip(sequences, logits):
        sequence.position += 1
        sequence.token = None
        try:
            results.append(StepResult(sequence.choose(row)))
        except Exception as exc:  # noqa: BLE001 - ends this sequence only; its caller re-raises it
            results.append(StepResult(error=exc))
    return results
