"""Prefill passes in slices, with the model lent to decode steps between them.

A prefill pass over many tokens holds the model for a long time (about a second for 2k tokens
of the embedded model on a 2-core CPU), and every open stream would pause that long. Here a
pass runs in chunks of at most :attr:`Chunking.tokens` tokens, one forward each, and calls
:attr:`Chunking.pause` between two chunks; with :attr:`Chunking.layers` it also calls it
between two decoder layers of a chunk (no extra forward, so no extra read of the weights: the
cheap boundary where a forward's fixed cost dominates, as on a CPU). The pause is where the
prompt work's holder lends the model to a waiting decode step
(:meth:`~kvboost_rag.hf.turns.ModelTurns.between_chunks`) and where a cancelled request
stops.

Every chunked pass gives what the whole pass gives, to float tolerance: the chunks run in
position order, and a token's K/V depends only on the tokens before it (causal attention by
position), which earlier chunks have written.

- :func:`append_pass`: tokens appended after what a cache holds (full prefill, the tokens
  after a prefix hit, a warm).
- :func:`scatter_pass`: tokens at scattered positions of an armed cache that holds every
  prompt position (the blend pass).
- :func:`batch_pass`: several rows behind one shared beginning (batched warming).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import torch

from kvboost_rag.hf.adapter import ModelAdapter
from kvboost_rag.hf.caches import BufferedCache, ModelCache
from kvboost_rag.hf.layers import DecoderLayers
from kvboost_rag.hf.transfer import host_to_device


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Chunking:
    """How a prompt's passes are cut and where they pause.

    Attributes:
        tokens: Most tokens (rows times columns in a batched pass) one forward runs.
        pause: Called between two chunks (and, with ``layers``, between two decoder layers).
        layers: The model's decoder layers, when a pass may also pause between them; ``None``:
            between chunks only (passes whose other threads' steps must not run mid-forward,
            such as captured steps compiled over the model).
    """

    tokens: int = 1 << 30
    pause: Callable[[], None] = _nothing
    layers: DecoderLayers | None = None

    def spans(self, count: int, last_at_least: int = 1) -> list[tuple[int, int]]:
        """``[start, stop)`` of each chunk of ``count`` tokens, in order; the last one holds
        at least ``last_at_least`` tokens (when there are that many: it may then be longer
        than the others)."""
        starts = list(range(0, count, max(1, self.tokens)))
        tail = min(count, max(1, last_at_least))
        if starts and count - starts[-1] < tail:
            last = count - tail
            starts = [start for start in starts if start < last] + [last]
        return list(zip(starts, [*starts[1:], count]))

    def chunks(self, count: int, last_at_least: int = 1) -> Iterator[tuple[int, int]]:
        """:meth:`spans`, pausing before every chunk but the first."""
        for k, span in enumerate(self.spans(count, last_at_least)):
            if k:
                self.pause()
            yield span

    def within_pass(self) -> ContextManager[None]:
        """The block of one whole forward: pauses between its decoder layers (with ``layers``)."""
        if self.layers is None:
            return nullcontext()
        return self.layers.between_layers(self.pause)


#: One pass, no pause: what callers without turns (tests, tools) use.
WHOLE = Chunking()


@torch.inference_mode()
def append_pass(
    adapter: ModelAdapter,
    chunking: Chunking,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: ModelCache,
    sparse_queries: bool,
) -> torch.Tensor:
    """Run ``input_ids`` ``[m]`` at ``positions`` ``[m]`` (consecutive) after what ``cache``
    holds, in chunks; the ``[vocab]`` logits of the last token.

    Args:
        sparse_queries: The first chunk runs on top of a cache already (a prefix hit): causal
            attention by position (:meth:`ModelAdapter.forward`); later chunks always do.
    """
    logits = None
    for start, stop in chunking.chunks(len(input_ids)):
        with chunking.within_pass():
            logits = adapter.forward(
                input_ids[start:stop], positions[start:stop], cache, sparse_queries=sparse_queries or start > 0
            )
    assert logits is not None, "a pass of no token"
    return logits


@torch.inference_mode()
def scatter_pass(
    adapter: ModelAdapter,
    chunking: Chunking,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: BufferedCache,
) -> torch.Tensor:
    """Run the tokens of ``input_ids`` ``[n]`` (every prompt token) at the sorted
    ``positions`` over ``cache``, which holds every prompt position, in chunks: each chunk's
    K/V is scattered into its positions and attention is causal by position; the ``[vocab]``
    logits of the last one.

    The rows of the positions later chunks compute are zeroed first: no query of an earlier
    chunk attends to them (they come after it), and a row nobody wrote must not hold what an
    attention kernel could turn into NaN even where it masks it.
    """
    spans = chunking.spans(len(positions))
    if len(spans) > 1:
        zero_rows(cache, positions[spans[1][0] :])
    logits = None
    for start, stop in chunking.chunks(len(positions)):
        chunk = positions[start:stop]
        cache.arm(host_to_device(chunk, adapter.device))
        with chunking.within_pass():
            logits = adapter.forward(input_ids[chunk], chunk, cache, sparse_queries=True)
    assert logits is not None, "a pass of no token"
    return logits


@torch.inference_mode()
def batch_pass(
    adapter: ModelAdapter, chunking: Chunking, input_ids: torch.Tensor, positions: torch.Tensor, cache: BufferedCache
) -> None:
    """:meth:`ModelAdapter.forward_batch` of ``[rows, width]`` tokens in chunks of columns
    (``chunking.tokens`` over the rows, at least one column each)."""
    rows, width = input_ids.shape
    columns = Chunking(max(1, chunking.tokens // max(1, rows)), chunking.pause, chunking.layers)
    for start, stop in columns.chunks(width):
        with chunking.within_pass():
            adapter.forward_batch(input_ids[:, start:stop], positions[:, start:stop], cache)


def zero_rows(cache: BufferedCache, positions: torch.Tensor) -> None:
    """Zero the K/V rows of ``positions`` in every layer of ``cache`` (rows a later chunk of a
    pass writes: read by no earlier query, and never NaN)."""
    keys, values = ModelAdapter.cache_tensors(cache)  # [layers, heads, tokens, dim] views
    index = host_to_device(positions, keys.device)
    keys.index_fill_(2, index, 0)
    values.index_fill_(2, index, 0)
