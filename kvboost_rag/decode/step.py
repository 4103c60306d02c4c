"""Decoding several sequences together: per-sequence state and one batched step.

A :class:`DecodeSequence` is one prompt after its prefill: its cache, the position of its
next token, its options, sampler, text assembler and budget. :func:`decode_step` feeds the
pending token of every sequence, and the tokens drafted after it
(:mod:`kvboost_rag.decode.drafting`), through the model in one forward pass
(:meth:`~kvboost_rag.hf.adapter.ModelAdapter.forward_rows`: each sequence at its own position
over its own cache) and hands each sequence its logits. A sequence then chooses its tokens one
by one exactly as plain decoding would (greedy, sampling, constraint, repetition penalty), and
keeps going through the logits of its drafts while the token it chose is the one drafted: each
accepted draft is a token produced without a forward pass of its own. At the first token that
differs, the rows written for the rest of the draft are dropped from its cache (the next step
overwrites them; nothing reads them). EOS, stop strings and the token budget are per sequence,
exactly as when a sequence decodes alone; a sequence that finished simply is not passed to the
next step.

Sampling keeps its distribution: a drafted token is a point mass, and choosing the next token
from the model's distribution, then keeping the draft only if it is that token, accepts the
draft with the model's probability of it and otherwise yields a token from the model's
distribution without it: the speculative sampling rule. With a seeded generator the tokens are
the ones plain sampling draws, one draw per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvboost_rag.decode.draft_policy import DraftPolicy, SequenceDrafts, token_bucket
from kvboost_rag.decode.drafting import Drafter, Proposal
from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler, next_token, plain_greedy
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.caches import ModelCache, truncate_cache
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
        make_drafter: Builds its drafter at its first step (``None``: it never drafts).
        drafts: What it drafted and how much of it was accepted.
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
    make_drafter: Callable[[], Drafter] | None = None
    drafts: SequenceDrafts = field(default_factory=SequenceDrafts)
    _drafter: Drafter | None = field(default=None, repr=False)
    _fed: int = field(default=0, repr=False)

    @property
    def done(self) -> bool:
        """Whether it produced its last token."""
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor, argmax: int | None = None) -> list[str]:
        """Choose the next token from this step's ``[vocab]`` logits and account for it.

        Args:
            logits: The logits.
            argmax: Their argmax, when computed already (see :func:`next_token`).

        Returns:
            Text pieces now safe to show (see :meth:`take`).
        """
        if self.options.return_logits:
            self.step_logits.append(logits.detach().to("cpu", copy=True))
        return self.take(next_token(logits, self.options, self.sampling, argmax))

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

    def propose(self) -> Proposal | None:
        """What its texts suggest after its tokens so far (at most what its budget leaves
        room for after the pending token, and only what its constraint allows)."""
        if self.make_drafter is None:
            return None
        if self._drafter is None:
            self._drafter = self.make_drafter()
        generated = self.sampling.generated
        self._drafter.accept(generated[self._fed :])
        self._fed = len(generated)
        proposal = self._drafter.propose(self.budget - self.produced - 1)
        guide = self.sampling.guide
        if proposal is not None and guide is not None:
            allowed = guide.valid_prefix(proposal.tokens)
            proposal = Proposal(proposal.tokens[:allowed], proposal.match_length, proposal.source) if allowed else None
        return proposal

    def verify(self, logits: torch.Tensor, draft: Sequence[int], argmax: Sequence[int] | None = None) -> tuple[list[str], int]:
        """Choose tokens from the ``[1 + len(draft), vocab]`` logits of a step that fed the
        pending token and ``draft``: one token per row, as plain decoding would, going on to
        the next row while the token chosen is the one drafted there.

        Args:
            logits: The rows' logits.
            draft: The drafted tokens.
            argmax: Each row's argmax, when computed already (see :func:`next_token`).

        Returns:
            ``(text pieces, drafted tokens accepted)``; the cache keeps the fed tokens whose
            K/V the next tokens were computed from and drops the rest.
        """
        pieces: list[str] = []
        accepted = 0
        for row in range(len(draft) + 1):
            pieces += self.choose(logits[row], None if argmax is None else argmax[row])
            if self.done or row == len(draft) or self.sampling.generated[-1] != draft[row]:
                break
            accepted += 1
        self.position += accepted + 1
        if accepted < len(draft) and not self.done:
            truncate_cache(self.cache, self.position)
        return pieces, accepted


@dataclass
class StepResult:
    """What one step did for one sequence: new text pieces, or the error that ended it."""

    pieces: list[str] = field(default_factory=list)
    error: BaseException | None = None


def decode_step(
    adapter: ModelAdapter, sequences: Sequence[DecodeSequence], policy: DraftPolicy | None = None
) -> list[StepResult]:
    """Feed every sequence's pending token, and its draft, in one forward pass and choose its
    next tokens.

    Args:
        adapter: The model adapter.
        sequences: Sequences not done, each with a pending ``token``.
        policy: Chooses draft lengths and learns from the outcome (``None``: no drafts).

    Returns:
        One result per sequence, in order. Choosing or detokenizing a token that fails ends
        that sequence only (its ``error``); the others go on.

    Raises:
        Exception: Whatever the forward pass raised (no sequence advanced).
    """
    drafts = _drafts(sequences, policy)
    width = token_bucket(1 + max(len(d) for d, _ in drafts))
    tokens = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, (sequence, (draft, _)) in enumerate(zip(sequences, drafts)):
        row = [sequence.token, *draft]
        tokens[b, : len(row)] = torch.tensor(row)
        tokens[b, len(row) :] = row[-1]
    positions = torch.tensor([s.position for s in sequences])
    counts = [1 + len(d) for d, _ in drafts]
    start = time.perf_counter()
    logits = adapter.forward_rows(tokens, positions, counts, [s.cache for s in sequences])  # [batch, width, vocab]
    # Greedy rows take their argmax from one device read for the whole step.
    greedy = [plain_greedy(s.options, s.sampling) for s in sequences]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else [None] * len(sequences)
    results = [
        _advance(sequence, rows, draft, proposal, policy, choices if plain else None)
        for sequence, rows, (draft, proposal), plain, choices in zip(sequences, logits, drafts, greedy, argmax)
    ]
    if policy is not None:
        policy.costs.record(len(sequences), width, time.perf_counter() - start)
    return results


def _drafts(sequences: Sequence[DecodeSequence], policy: DraftPolicy | None) -> list[tuple[list[int], Proposal | None]]:
    """Each sequence's draft for this step and the proposal it came from."""
    drafts: list[tuple[list[int], Proposal | None]] = []
    for sequence in sequences:
        proposal = sequence.propose() if policy is not None and policy.max_tokens else None
        if proposal is None:
            drafts.append(([], None))
            continue
        length = policy.length(sequence.drafts, proposal.source, proposal.match_length, len(proposal.tokens), len(sequences))
        drafts.append((proposal.tokens[:length], proposal if length else None))
    return drafts


def _advance(
    sequence: DecodeSequence,
    logits: torch.Tensor,
    draft: list[int],
    proposal: Proposal | None,
    policy: DraftPolicy | None,
    argmax: list[int] | None,
) -> StepResult:
    """Hand a sequence its rows of a step's logits; a failure ends that sequence only."""
    sequence.token = None
    sequence.drafts.decode_steps += 1
    try:
        pieces, accepted = sequence.verify(logits, draft, argmax)
    except Exception as exc:  # noqa: BLE001 - ends this sequence only; its caller re-raises it
        return StepResult(error=exc)
    if proposal is not None and policy is not None:
        evaluated = min(accepted + 1, len(draft)) if not sequence.done else accepted
        policy.record(sequence.drafts, proposal.source, proposal.match_length, accepted, evaluated)
        sequence.drafts.draft_steps += 1
        sequence.drafts.drafted_tokens += accepted
    return StepResult(pieces)
