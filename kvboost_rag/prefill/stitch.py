"""Placing loaded K/V into a prompt's buffers with a fixed number of operations per call.

Whatever the number of documents, chunks or layers, the stitch of one prompt is:

- prefix pieces: one concatenation of every piece's rows, written straight into the buffers'
  first rows (per K and V);
- document chunks: one concatenation of the rows the prompt uses, written straight into the
  span of prompt positions they cover (per K and V), then one re-rotation of every key of
  that span in place (each run of rows by its own position shift; the adapter's rotation,
  a slice of layers at a time so that its float32 temporaries stay bounded).

Everything the host decides (which rows go where, by how many positions each run moves) is
computed on the host from Python ints, before any tensor work, and sent to the device in one
asynchronous copy per table (:func:`~kvboost_rag.transfer.host_to_device`): nothing here
reads a tensor value back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from kvboost_rag.cache.codec import KVBlock
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.transfer import host_to_device


@dataclass(frozen=True)
class Run:
    """Consecutive rows of one loaded block placed at consecutive prompt positions.

    Attributes:
        block: Index of the block in the call's list of loaded blocks.
        row: First row of the block used.
        position: Prompt position of that row.
        length: Rows in the run.
    """

    block: int
    row: int
    position: int
    length: int


def row_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    """Bytes one prompt position takes in ``keys`` and ``values`` (``[layers, heads, capacity,
    dim]`` buffers): what a stitch copies per loaded row."""
    return (keys[:, :, :1].numel() + values[:, :, :1].numel()) * keys.element_size()


def stitch_prefix(keys: torch.Tensor, values: torch.Tensor, pieces: Sequence[tuple[KVBlock, int]]) -> int:
    """Copy the leading rows of consecutive prefix blocks into the buffers' first rows.

    Args:
        keys: ``[layers, heads, capacity, dim]`` buffer.
        values: Same for V.
        pieces: ``(block, rows used)`` in prompt order, each starting where the last ended.

    Returns:
        Rows written (the prefix length).
    """
    if not pieces:
        return 0
    length = sum(used for _, used in pieces)
    torch.cat([block.keys[:, :, :used] for block, used in pieces], dim=2, out=keys[:, :, :length])  # [L, H, h, D]
    torch.cat([block.values[:, :, :used] for block, used in pieces], dim=2, out=values[:, :, :length])
    return length


def stitch_documents(
    adapter: ModelAdapter, keys: torch.Tensor, values: torch.Tensor, blocks: Sequence[KVBlock], runs: Sequence[Run]
) -> list[tuple[int, int]]:
    """Copy the runs' rows from the loaded blocks into the buffers and re-rotate their keys to
    the prompt positions.

    The span of positions from the first run to the end of the last is written as one
    concatenation (per K and V) of the runs' rows and, for the positions between runs (live
    tokens, which the model writes before it reads them), zeros; the keys of that span are then
    rotated in place in one pass, each run by its own shift (the rows between runs by none).

    Args:
        adapter: The model adapter (rotation tables).
        keys: ``[layers, heads, capacity, dim]`` buffer.
        values: Same for V.
        blocks: The loaded blocks (``[layers, heads, rows, dim]`` each, on the buffers' device).
        runs: Where each run of rows goes, sorted by position, not overlapping.

    Returns:
        ``(position, length)`` of every run written.
    """
    if not runs:
        return []
    runs = sorted(runs, key=lambda run: run.position)
    start, stop = runs[0].position, runs[-1].position + runs[-1].length
    gaps = [b.position - (a.position + a.length) for a, b in pairwise(runs)]
    if min(gaps, default=0) < 0:
        raise ValueError("document runs overlap")
    filler_shape = (keys.shape[0], keys.shape[1], max(gaps, default=0), keys.shape[3])
    filler = keys.new_zeros(filler_shape)  # [L, H, widest gap, D]: rows the model writes later
    key_parts: list[torch.Tensor] = []
    value_parts: list[torch.Tensor] = []
    for run, gap in zip(runs, [*gaps, 0]):
        block, rows = blocks[run.block], slice(run.row, run.row + run.length)
        key_parts.append(block.keys[:, :, rows])
        value_parts.append(block.values[:, :, rows])
        if gap:
            key_parts.append(filler[:, :, :gap])
            value_parts.append(filler[:, :, :gap])
    span = slice(start, stop)
    torch.cat(key_parts, dim=2, out=keys[:, :, span])  # [L, H, stop - start, D]
    torch.cat(value_parts, dim=2, out=values[:, :, span])
    shifts = [run.position - (blocks[run.block].start_position + run.row) for run in runs]
    if any(shifts):
        _rotate_span(adapter, keys[:, :, span], runs, gaps, shifts)
    return _expand([run.position for run in runs], [run.length for run in runs])


def _expand(firsts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """``[sum(lengths)]`` host tensor: ``firsts[i], firsts[i] + 1, ...`` for ``lengths[i]`` each."""
    counts = torch.tensor(lengths)
    starts = torch.repeat_interleave(torch.tensor(firsts) - (counts.cumsum(0) - counts), counts)
    return starts + torch.arange(int(counts.sum()))


def _rotate_span(
    adapter: ModelAdapter, span: torch.Tensor, runs: Sequence[Run], gaps: Sequence[int], shifts: Sequence[int]
) -> None:
    """Rotate ``span`` (``[L, H, tokens, D]``, a view of the K buffer) in place: the rows of
    run ``i`` by ``shifts[i]``, the rows between runs not at all."""
    # Row r of the tables is run r's rotation; the last row (shift 0) is the rows between runs.
    cos, sin = adapter.rotation([*shifts, 0])  # [1 or L, runs + 1, half]
    table_rows = [row for i in range(len(runs)) for row in (i, len(runs))]  # run i, then its gap
    sizes = [size for run, gap in zip(runs, [*gaps, 0]) for size in (run.length, gap)]
    index = host_to_device(torch.repeat_interleave(torch.tensor(table_rows), torch.tensor(sizes)), span.device)
    adapter.apply_rotation(span, cos.index_select(1, index), sin.index_select(1, index), out=span)  # [., tokens, half] tables
