"""What one captured step runs, as the host describes it, and the logits it gives back.

A step runs the new tokens of several rows (sequences) in one forward pass: one token per row
for a decode step, ``1 + k`` for a draft-verify step, chosen tokens at scattered positions of
one prompt for a blend pass; rows may have different counts. The
rows' tokens are laid end to end on one token axis, padded to a token bucket (a fixed size the
step's graph was built for), so the number of graphs is the number of buckets whatever the
batch and the prompt lengths.

Everything the step needs is computed here, on the host, into one ``int64`` table
(:func:`pack_rows`), copied to the device in one copy before the step: per token its id, its
position, its pool row (where its K/V is written, and the last row its query reads: attention
is causal by position) and the first pool row its query may read (its slot's first row; a
layer with a sliding window reads from inside the window, which the device derives).
Padded tokens write to the pool's scratch region and read only it, so they never change a
real row and never read an empty range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.hf.captured.pool import Slot

#: Rows of the table :func:`pack_rows` fills, in order.
TOKENS, POSITIONS, POOL_ROWS, FIRST_KEY = range(4)
#: Rows of the table.
FIELDS = 4
#: Token id of padded tokens (any id the embedding holds).
PAD_TOKEN = 0


@dataclass(frozen=True)
class Row:
    """One sequence's part of a step.

    Attributes:
        slot: The pool slot holding its K/V.
        tokens: Its new tokens (one for a decode step, the pending token and its drafts for a
            draft-verify step).
        position: Position of its first new token: the slot holds positions ``0..position - 1``
            (the sequence's length, which the caller keeps).
        positions: Instead of ``position``, each token's own position, ascending (a blend
            pass: chosen tokens of a prompt whose slot holds every position; each token's K/V
            replaces the row at its position, and attention is causal by position).
    """

    slot: Slot
    tokens: Sequence[int]
    position: int = 0
    positions: Sequence[int] | None = None

    def token_positions(self) -> Sequence[int]:
        """Each token's position.

        Raises:
            InvalidInputError: No token, positions not ascending or outside the slot, or not one
                per token.
        """
        count = len(self.tokens)
        positions = range(self.position, self.position + count) if self.positions is None else self.positions
        ordered = all(a < b for a, b in zip(positions, positions[1:]))
        if count == 0 or len(positions) != count or not ordered or positions[0] < 0 or positions[-1] >= self.slot.capacity:
            raise InvalidInputError(
                f"a row needs 1 or more tokens at ascending positions within its slot: {count} tokens at "
                f"{positions[0] if len(positions) else None}..{positions[-1] if len(positions) else None} in a slot "
                f"of {self.slot.capacity} (take a larger slot, or run it on the eager path)"
            )
        return positions


def token_bucket(tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest of ``buckets`` holding ``tokens`` tokens (``None``: too many)."""
    fitting = [b for b in buckets if b >= tokens]
    return min(fitting) if fitting else None


def pack_rows(rows: Sequence[Row], bucket: int, scratch_start: int) -> torch.Tensor:
    """The host table of one step: ``[FIELDS, bucket]`` int64.

    Args:
        rows: The rows, in order; their tokens are laid end to end.
        bucket: Tokens of the step (at least the rows' tokens together).
        scratch_start: First scratch row of the pool.

    Raises:
        InvalidInputError: A row without tokens, or with positions out of order or past its
            slot, or more tokens than ``bucket``.
    """
    columns: list[list[int]] = []
    for row in rows:
        for token, position in zip(row.tokens, row.token_positions()):
            columns.append([int(token), position, row.slot.start + position, row.slot.start])
    if len(columns) > bucket:
        raise InvalidInputError(f"{len(columns)} tokens do not fit a step of {bucket}")
    for pad in range(bucket - len(columns)):
        pool_row = scratch_start + pad  # each padded token writes its own scratch row, reads from the first
        columns.append([PAD_TOKEN, pad, pool_row, scratch_start])
    return torch.tensor(columns, dtype=torch.int64).t().contiguous()


@dataclass(frozen=True)
class StepLogits:
    """The logits of one step.

    Attributes:
        flat: ``[bucket, vocab]`` float32 on the model's device, every token of every row end
            to end, then the padded tokens (to be ignored). Valid until the next step of the
            same bucket (on CUDA it is the captured graph's output buffer): read or copy it
            before.
        offsets: Where each row's tokens start in ``flat``.
        counts: How many tokens each row ran.
    """

    flat: torch.Tensor
    offsets: tuple[int, ...]
    counts: tuple[int, ...]

    def row(self, index: int) -> torch.Tensor:
        """``[tokens, vocab]`` logits of row ``index``'s tokens (a view of :attr:`flat`)."""
        start = self.offsets[index]
        return self.flat[start : start + self.counts[index]]

    def last(self, index: int) -> torch.Tensor:
        """``[vocab]`` logits of row ``index``'s last token (a view)."""
        return self.flat[self.offsets[index] + self.counts[index] - 1]

    @classmethod
    def of(cls, flat: torch.Tensor, rows: Sequence[Row]) -> StepLogits:
        """Logits ``flat`` of a step over ``rows`` (offsets and counts from the rows)."""
        counts = tuple(len(row.tokens) for row in rows)
        offsets, start = [], 0
        for count in counts:
            offsets.append(start)
            start += count
        return cls(flat, tuple(offsets), counts)
