"""Decoding several sequences together: per-sequence state and one batched step.

A :class:`DecodeSequence` is one prompt after its prefill: its cache, the position of its
next token, its options, sampler, text assembler and budget. :func:`decode_step` feeds the
pending token of every sequence, and the tokens drafted after it
(:mod:`kvboost_rag.decode.drafting`), through the model in one forward pass (:class:`DecodeRows`:
each sequence a segment of a packed pass, at its own positions over its own cache, beside the
prompt work the engine loop runs in the same pass) and hands each sequence its logits. A sequence then chooses its tokens one
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvboost_rag.decode.draft_policy import DraftPolicy, SequenceDrafts, token_bucket
from kvboost_rag.decode.drafting import Drafter, Proposal
from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler, next_token, plain_greedy
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.caches import ModelCache, truncate_cache
from kvboost_rag.hf.captured import CapturedRows, Row, Slot
from kvboost_rag.hf.packed import Segment, SegmentOutput
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
        make_drafter: Builds its drafter at its first step (``None``: it never drafts).
        drafts: What it drafted and how much of it was accepted.
        slot: Its slot of the captured steps' pool when it decodes through captured steps
            (its K/V live there; ``cache`` keeps the prompt's length and ``position`` is its
            length); ``None``: eager steps over ``cache``.
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
    make_drafter: Callable[[], Drafter] | None = None
    drafts: SequenceDrafts = field(default_factory=SequenceDrafts)
    slot: Slot | None = None
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
        if accepted < len(draft) and not self.done and self.slot is None:  # a slot's length is ``position``
            truncate_cache(self.cache, self.position)
        return pieces, accepted


@dataclass
class StepResult:
    """What one step did for one sequence: new text pieces, or the error that ended it."""

    pieces: list[str] = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class DecodeRows:
    """One step's decode rows: every sequence's pending token and its draft.

    Sequences with a slot of the captured steps' pool run through captured steps; the others
    are :meth:`segments` of the step's packed pass (beside prompt work, in the engine loop).

    Attributes:
        sequences: The sequences (not done, each with a pending ``token``).
        drafts: Each one's draft and the proposal it came from.
        slotted: Whether each one runs through the captured steps.
        failed: Sequences whose draft planning raised (their drafter, their constraint's
            check of a draft), with the error: they have no row in this step, and the error
            ends them alone.
    """

    sequences: list[DecodeSequence]
    drafts: list[tuple[list[int], Proposal | None]]
    slotted: list[bool]
    failed: list[tuple[DecodeSequence, Exception]] = field(default_factory=list)

    @classmethod
    def plan(
        cls,
        sequences: Sequence[DecodeSequence],
        policy: DraftPolicy | None = None,
        captured: CapturedRows | None = None,
        row_tokens: int | None = None,
    ) -> DecodeRows:
        """Each sequence's row of the next step (its draft chosen by ``policy``; ``None``: no
        drafts), at most ``row_tokens`` tokens a row (``None``: as many as the policy
        drafts). A sequence whose draft planning raises gets no row: it is in
        :attr:`failed` with its error, and the others are planned as if it were not there."""
        slotted = [captured is not None and s.slot is not None for s in sequences]
        per_row = None if captured is None or not any(slotted) else max(1, captured.max_tokens // sum(slotted))
        caps = [per_row if flag else row_tokens for flag in slotted]
        drafts = _drafts(sequences, policy, caps)
        kept = [i for i, draft in enumerate(drafts) if not isinstance(draft, Exception)]
        failed = [(sequences[i], draft) for i, draft in enumerate(drafts) if isinstance(draft, Exception)]
        return cls([sequences[i] for i in kept], [drafts[i] for i in kept], [slotted[i] for i in kept], failed)  # type: ignore[misc]

    def subset(self, indexes: Sequence[int]) -> DecodeRows:
        """The rows of these sequences only (in order)."""
        return DecodeRows(
            [self.sequences[i] for i in indexes], [self.drafts[i] for i in indexes], [self.slotted[i] for i in indexes]
        )

    @property
    def width(self) -> int:
        """The token bucket of the longest row (what step costs are kept by)."""
        return token_bucket(1 + max((len(d) for d, _ in self.drafts), default=0))

    @property
    def packed_rows(self) -> int:
        """Rows that are segments of the packed pass (not run through captured steps)."""
        return sum(1 for slotted in self.slotted if not slotted)

    @property
    def packed_tokens(self) -> int:
        """Tokens those rows feed in all (pending tokens and drafts)."""
        return sum(1 + len(draft) for (draft, _), slotted in zip(self.drafts, self.slotted) if not slotted)

    def segments(self) -> list[Segment]:
        """The rows not run through captured steps, as segments of a packed pass: the pending
        token and the draft at the sequence's next positions, every token's logits back."""
        out = []
        for sequence, (draft, _), slotted in zip(self.sequences, self.drafts, self.slotted):
            if slotted:
                continue
            tokens = [sequence.token, *draft]
            positions = torch.arange(sequence.position, sequence.position + len(tokens))
            out.append(Segment(torch.tensor(tokens), positions, sequence.cache, logits=len(tokens), decode=True))  # type: ignore[arg-type]
        return out

    def finish(
        self, outputs: Sequence[SegmentOutput], policy: DraftPolicy | None = None, captured: CapturedRows | None = None
    ) -> list[StepResult]:
        """Hand each sequence its logits (``outputs``: those of :meth:`segments`, in order; the
        captured rows run here) and choose its next tokens.

        Returns:
            One result per sequence, in order. Choosing or detokenizing a token that fails ends
            that sequence only (its ``error``); the others go on.
        """
        rows: list[tuple[torch.Tensor, list[int] | None]] = []
        eager = [s for s, slotted in zip(self.sequences, self.slotted) if not slotted]
        eager_rows = iter(_with_argmax([output.logits for output in outputs], eager))
        slotted_indexes = [i for i, flag in enumerate(self.slotted) if flag]
        captured_rows: Iterator = iter(())
        if slotted_indexes:
            assert captured is not None, "rows in slots need the captured steps"
            captured_rows = iter(_captured_rows(
                captured, [self.sequences[i] for i in slotted_indexes], [self.drafts[i][0] for i in slotted_indexes]
            ))
        rows = [next(captured_rows) if slotted else next(eager_rows) for slotted in self.slotted]
        return [
            _advance(sequence, logits, draft, proposal, policy, argmax)
            for sequence, (logits, argmax), (draft, proposal) in zip(self.sequences, rows, self.drafts)
        ]


def decode_step(
    adapter: ModelAdapter,
    sequences: Sequence[DecodeSequence],
    policy: DraftPolicy | None = None,
    captured: CapturedRows | None = None,
) -> list[StepResult]:
    """Feed every sequence's pending token, and its draft, in one forward pass and choose its
    next tokens (a step of decode rows alone; the engine loop runs :class:`DecodeRows` beside
    prompt work instead).

    Args:
        adapter: The model adapter.
        sequences: Sequences not done, each with a pending ``token``.
        policy: Chooses draft lengths and learns from the outcome (``None``: no drafts).
        captured: The captured steps the sequences with a slot decode through (all their rows
            in one step, or a few when they hold more tokens than one step takes).

    Returns:
        One result per sequence, in order (see :meth:`DecodeRows.finish`).

    Raises:
        Exception: Whatever the forward pass raised (no sequence advanced).
    """
    rows = DecodeRows.plan(sequences, policy, captured)
    start = time.perf_counter()
    segments = rows.segments()
    outputs = adapter.forward_segments(segments) if segments else []
    stepped = dict(zip(map(id, rows.sequences), rows.finish(outputs, policy, captured)))
    if policy is not None and rows.sequences:
        policy.costs.record(len(rows.sequences), rows.width, time.perf_counter() - start)
    stepped.update((id(sequence), StepResult(error=error)) for sequence, error in rows.failed)
    return [stepped[id(sequence)] for sequence in sequences]


def _with_argmax(
    logits: Sequence[torch.Tensor | None], sequences: Sequence[DecodeSequence]
) -> list[tuple[torch.Tensor, list[int] | None]]:
    """Each row's ``[tokens, vocab]`` logits and, for the sequences that decode plain greedy,
    their argmax, read from the device in one copy."""
    greedy = [plain_greedy(s.options, s.sampling) for s in sequences]
    argmax: list[list[int] | None] = [None] * len(sequences)
    picked = [rows for rows, plain in zip(logits, greedy) if plain]
    if picked:
        flat = torch.cat(picked).argmax(dim=-1).tolist()  # type: ignore[arg-type]
        offset = 0
        for i, (rows, plain) in enumerate(zip(logits, greedy)):
            if plain:
                count = rows.shape[0]  # type: ignore[union-attr]
                argmax[i], offset = flat[offset : offset + count], offset + count
    return [(rows, picked_argmax) for rows, picked_argmax in zip(logits, argmax)]  # type: ignore[misc]


def _captured_rows(
    captured: CapturedRows, sequences: Sequence[DecodeSequence], drafts: Sequence[list[int]]
) -> list[tuple[torch.Tensor, list[int] | None]]:
    """Each sequence's logits from captured steps over the pool (as few steps as their tokens
    allow): views of the step's output, copied only when a second step would overwrite it."""
    out: list[tuple[torch.Tensor, list[int] | None]] = []
    group: list[Row] = []
    members: list[DecodeSequence] = []

    def flush() -> None:
        if out:  # the graph's output is overwritten by its next run: keep what was read so far
            out[:] = [(logits.clone(), argmax) for logits, argmax in out]
        step = captured.run(group)
        greedy = any(plain_greedy(s.options, s.sampling) for s in members)
        argmax = step.flat.argmax(dim=-1).tolist() if greedy else None
        for index, sequence in enumerate(members):
            logits = step.row(index)
            start, count = step.offsets[index], step.counts[index]
            plain = argmax is not None and plain_greedy(sequence.options, sequence.sampling)
            out.append((logits, argmax[start : start + count] if plain else None))
        group.clear()
        members.clear()

    for sequence, draft in zip(sequences, drafts):
        row = Row(sequence.slot, [sequence.token, *draft], sequence.position)  # type: ignore[arg-type]
        if group and sum(len(r.tokens) for r in group) + len(row.tokens) > captured.max_tokens:
            flush()
        group.append(row)
        members.append(sequence)
    flush()
    return out


def _drafts(
    sequences: Sequence[DecodeSequence], policy: DraftPolicy | None, caps: Sequence[int | None]
) -> list[tuple[list[int], Proposal | None] | Exception]:
    """Each sequence's draft for this step and the proposal it came from (``caps``: most
    tokens a row may run in all, where a captured step or the step's budget bounds it), or
    the exception its planning raised (its drafter, its constraint's check of the draft)."""
    drafts: list[tuple[list[int], Proposal | None] | Exception] = []
    for sequence, cap in zip(sequences, caps):
        try:
            proposal = sequence.propose() if policy is not None and policy.max_tokens and cap != 1 else None
        except Exception as error:  # noqa: BLE001 - ends this sequence only (DecodeRows.failed)
            drafts.append(error)
            continue
        if proposal is None:
            drafts.append(([], None))
            continue
        available = len(proposal.tokens) if cap is None else min(len(proposal.tokens), cap - 1)
        length = policy.length(sequence.drafts, proposal.source, proposal.match_length, available, len(sequences))
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
