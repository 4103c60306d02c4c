"""Forward passes as requests: what prompt work asks the engine loop to run.

Prompt work (a prefill, the repair's probe and blend pass, a document being warmed) is written
as a generator that yields what it needs from the model and is sent the result:

- :class:`TokenPass`: tokens at sorted positions over one cache, as many as the work needs.
  The engine loop runs it in slices, each a segment of one step's packed pass beside the
  running answers' next tokens and other prompt work (:mod:`kvboost_rag.hf.packed`); the
  result is the whole pass's, to float tolerance: the slices run in position order, and a
  token's K/V depends only on the tokens at positions before it, which earlier slices (or the
  cache) hold.
- :class:`ModelCall`: model work that runs whole, alone (a pass through part of the model,
  a captured pass): a callable the loop's thread runs between two steps.

:func:`run_now` runs such a generator at once, each pass whole or in slices of a given size
(tools and tests, and anything that runs without the engine loop).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

import torch

from kvboost_rag.hf.adapter import ModelAdapter
from kvboost_rag.hf.caches import BufferedCache
from kvboost_rag.hf.packed import Segment, SegmentOutput
from kvboost_rag.transfer import host_to_device

T = TypeVar("T")


@dataclass(frozen=True)
class PassResult:
    """What a :class:`TokenPass` gives back.

    Attributes:
        logits: ``[vocab]`` float32 logits of its last token (``None`` unless asked for).
        recorded: One ``[keys]`` tensor per recorded layer (see :attr:`TokenPass.record`).
    """

    logits: torch.Tensor | None = None
    recorded: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of_last_slice(cls, output: SegmentOutput) -> PassResult:
        """The pass's result from its last slice's output."""
        return cls(None if output.logits is None else output.logits[-1], output.recorded)


@dataclass(eq=False)
class TokenPass:
    """Tokens at sorted positions over one cache, run in slices by the engine loop.

    Attributes:
        ids: ``[m]`` host token ids.
        positions: ``[m]`` host int64 positions, ascending: right after what ``cache`` holds
            (appended: a prefill, a chunk after a prefix hit, a warm) or inside a cache that
            holds every position of its prompt (scattered: the blend pass, the probe).
        cache: The cache the tokens' K/V goes into and their attention reads.
        logits: Return the last token's logits.
        record: Record the attention of this many of the last tokens (the probe); the last
            slice then holds at least that many tokens.
        record_layers: Layers recorded, from the first (``None``: all).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    cache: BufferedCache
    logits: bool = False
    record: int = 0
    record_layers: int | None = None

    def __len__(self) -> int:
        return int(self.ids.numel())

    def next_stop(self, done: int, budget: int) -> int:
        """Where the slice after ``done`` tokens ends for a budget of ``budget`` tokens (at
        least one): the rest when it fits, else ``done + budget``, moved back so that the
        last slice holds the recorded queries."""
        count = len(self)
        stop = min(count, done + max(1, budget))
        if stop < count and count - stop < self.record:
            stop = count - self.record if count - self.record > done else count
        return stop

    def slice_after(self, done: int, budget: int) -> Segment:
        """The slice after ``done`` tokens for a budget of ``budget`` tokens
        (:meth:`next_stop`), as a segment of a packed pass; before the first slice of a cut
        pass, the rows later slices write are prepared (:meth:`before_slices`)."""
        stop = self.next_stop(done, budget)
        if done == 0 and stop < len(self):
            self.before_slices(stop)
        return self.segment(done, stop)

    def segment(self, start: int, stop: int) -> Segment:
        """The slice ``[start, stop)`` as a segment of a packed pass (the logits and recorded
        attention come from the last slice only)."""
        last = stop == len(self)
        return Segment(
            self.ids[start:stop],
            self.positions[start:stop],
            self.cache,
            logits=1 if last and self.logits else 0,
            record=self.record if last else 0,
            record_layers=self.record_layers,
        )

    def before_slices(self, first_stop: int) -> None:
        """Called once, before the first slice (ending at ``first_stop``) when the pass is
        cut: the rows of the positions later slices compute, where the cache already holds
        positions (a scattered pass), are zeroed. No query of an earlier slice attends to
        them (they come after it), but a row nobody wrote must not hold what an attention
        kernel could turn into NaN even where it masks it."""
        later = self.positions[first_stop:]
        held = self.cache.get_seq_length()
        inside = later[later < held]
        if inside.numel():
            zero_rows(self.cache, inside)


@dataclass(eq=False)
class ModelCall:
    """Model work that runs whole and alone, on the loop's thread.

    Attributes:
        run: The work; its return value is sent back to the prompt work.
        tokens: Tokens it computes (how much of a step it is).
    """

    run: Callable[[], Any]
    tokens: int = 0


PassRequest = Union[TokenPass, ModelCall]
#: Prompt work: a generator of the passes it needs, returning its result.
PassSteps = Generator[PassRequest, Any, T]


def run_now(adapter: ModelAdapter, steps: PassSteps[T], slice_tokens: int | None = None) -> T:
    """Run prompt work at once on this thread, each :class:`TokenPass` as one pass, or in
    slices of ``slice_tokens`` tokens.

    Args:
        adapter: The model adapter.
        steps: The prompt work.
        slice_tokens: Most tokens per pass (``None``: every pass whole).

    Returns:
        What the work returns.

    Raises:
        TypeError: The work asked for something that needs the engine loop.
    """
    reply: Any = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, TokenPass):
            reply = run_token_pass(adapter, request, slice_tokens)
        elif isinstance(request, ModelCall):
            reply = request.run()
        else:
            steps.close()
            raise TypeError(f"{type(request).__name__} needs the engine loop")


def run_token_pass(adapter: ModelAdapter, request: TokenPass, slice_tokens: int | None = None) -> PassResult:
    """Run one :class:`TokenPass` alone: whole, or in slices of ``slice_tokens`` tokens."""
    done, output = 0, None
    while done < len(request):
        segment = request.slice_after(done, slice_tokens or len(request))
        output = adapter.forward_segments([segment])[0]
        done += len(segment)
    assert output is not None, "a pass of no token"
    return PassResult.of_last_slice(output)


def zero_rows(cache: BufferedCache, positions: torch.Tensor) -> None:
    """Zero the K/V rows of ``positions`` in every layer of ``cache`` (rows a later slice of a
    pass writes: read by no earlier query, and never NaN)."""
    keys, values = ModelAdapter.cache_tensors(cache)  # [layers, heads, tokens, dim] views
    index = host_to_device(positions, keys.device)
    keys.index_fill_(2, index, 0)
    values.index_fill_(2, index, 0)
