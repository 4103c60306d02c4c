"""Whether this CPU's float32 products round a row alike whatever the count of rows.

A verify step's tokens attend in one product per K/V head (``groups x tokens`` rows) where a
one-token step has ``groups`` rows; drafts leave greedy tokens unchanged only if each row of a
product comes out bitwise the same in both. BLAS libraries choose their code by the product's
shape and the CPU: MKL on an AMD EPYC sums products of 1-3 rows another way than products of 4
or more (on the Intel Xeons where this was checked before, 2 rows already rounded as more). So the threshold is
measured once per process, head size and thread count, on products shaped like attention's,
and products with fewer rows are padded with zero rows up to it
(:func:`rows_rounding_alike`). Where no threshold is found, verify steps attend each token
alone, as a one-token step does.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

#: Row counts probed: every count a grouped-query verify step of up to 16 tokens commonly
#: forms, up to :data:`PROBE_MAX_ROWS`.
PROBE_ROWS = (*range(1, 33), 40, 48, 64, 96, 128)
PROBE_MAX_ROWS = PROBE_ROWS[-1]
#: Row offsets probed: a token's rows sit anywhere in a verify step's product.
PROBE_OFFSETS = (0, 1, 3, 6)
#: Key counts probed: ``(keys, columns)`` of the score product (a head's size by keys) and of
#: the value product (keys by a head's size), short and long.
PROBE_KEYS = (130, 2100)


def rows_rounding_alike(query_dim: int, value_dim: int, threads: int | None = None) -> int | None:
    """The fewest rows from which a float32 product of attention's shapes rounds each row
    bitwise alike whatever its count of rows and its place among them, on this CPU.

    Args:
        query_dim: Size of a query and key head.
        value_dim: Size of a value head.
        threads: Torch's intra-op threads (default: the current count); BLAS libraries may
            split a product another way with another count.

    Returns:
        The threshold (1 where every count rounds alike), or ``None`` where even the largest
        probed counts differ.
    """
    threads = torch.get_num_threads() if threads is None else threads
    return _measured(query_dim, value_dim, threads)


@functools.lru_cache(maxsize=64)
def _measured(query_dim: int, value_dim: int, threads: int) -> int | None:
    generator = torch.Generator().manual_seed(0)
    scores = [(query_dim, keys, True) for keys in PROBE_KEYS]  # a step of one token sees fewer keys
    values = [(keys, value_dim, False) for keys in (64, PROBE_KEYS[-1])]  # sums its anchor's keys
    alike = set(PROBE_ROWS)
    for inner, outer, fewer_columns in scores + values:
        alike &= _rows_alike(inner, outer, fewer_columns, generator)
    threshold = next((m for m in PROBE_ROWS if all(n in alike for n in PROBE_ROWS if n >= m)), None)
    if threshold is None:
        logger.warning(
            "this CPU's float32 products round rows by their count even at %d rows: verify steps attend each token alone",
            PROBE_MAX_ROWS,
        )
    elif threshold > 1:
        logger.info("this CPU's float32 products round alike from %d rows: shorter products are padded to it", threshold)
    return threshold


def _rows_alike(inner: int, outer: int, fewer_columns: bool, generator: torch.Generator) -> set[int]:
    """The probed row counts whose rows, at each probed offset (and over fewer columns where
    ``fewer_columns``), equal the same rows of one product of :data:`PROBE_MAX_ROWS` rows plus
    the largest offset."""
    left = torch.randn(2, PROBE_MAX_ROWS + PROBE_OFFSETS[-1], inner, generator=generator)
    right = torch.randn(2, inner, outer, generator=generator)
    whole = torch.matmul(left, right)
    fewer = right[..., : outer - 5]
    alike = set()
    for rows in PROBE_ROWS:
        parts = [left[:, offset : offset + rows] for offset in PROBE_OFFSETS]
        if all(
            torch.equal(torch.matmul(part, right), whole[:, offset : offset + rows])
            and (not fewer_columns or torch.equal(torch.matmul(part, fewer), whole[:, offset : offset + rows, : outer - 5]))
            for offset, part in zip(PROBE_OFFSETS, parts)
        ):
            alike.add(rows)
    return alike


def padded_rows(matrix: torch.Tensor, rows: int) -> torch.Tensor:
    """``matrix`` ``[batch, m, k]`` with zero rows appended up to ``rows`` (itself when it has
    as many already)."""
    batch, m, inner = matrix.shape
    if m >= rows:
        return matrix
    padded = matrix.new_zeros(batch, rows, inner)
    padded[:, :m] = matrix
    return padded


def product(left: torch.Tensor, right: torch.Tensor, fewest_rows: int) -> torch.Tensor:
    """``left @ right`` (``[batch, m, k] @ [batch, k, n]``) with ``left`` padded to at least
    ``fewest_rows`` rows, so each row rounds as in any other product of as many rows or more
    (contiguous either way)."""
    m = left.shape[1]
    if m >= fewest_rows:
        return torch.matmul(left, right)
    return torch.matmul(padded_rows(left, fewest_rows), right)[:, :m].contiguous()
