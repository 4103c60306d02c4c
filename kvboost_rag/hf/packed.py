"""One forward pass over several runs of tokens, each over its own K/V: a packed pass.

The engine loop runs each step as one forward pass that carries every running answer's next
token (and its drafts) together with slices of prompt work: a prefill chunk, the repair's
probe, its blend pass, a document being warmed. Each run is a :class:`Segment`: its tokens at
sorted positions over one sequence's cache. The model sees the segments end to end as one
sequence of ``T`` tokens (``[1, T]`` ids and positions): embeddings, projections, MLPs and the
output layer run once over all of them, so the weights are read once per step whatever it
carries, while attention runs segment by segment, each segment's queries over its own K/V:

- :class:`PackedCache` is the cache handed to the model: its layer ``i`` writes each segment's
  new K/V at the segment's positions in that segment's cache (appended after what it holds,
  or scattered into positions of a cache that holds every position of its prompt, the blend
  pass's and the probe's case) and leaves the segments' whole K/V for the attention function;
- :func:`packed_attention` (registered by :mod:`kvboost_rag.hf.attention_switch` as
  :data:`PACKED_ATTENTION`) gives query ``j`` of a segment the keys ``0..p_j`` of that segment
  (``p_j`` its position), within the layer's sliding window and with softcapping where the
  model applies them, as :mod:`kvboost_rag.attention_backends.sparse` does for one prompt: a segment's
  result is what a pass of that segment alone computes, to float rounding.

A segment may also record what its last queries attend to (the attention repair's probe), and
ask for the logits of its last tokens (a decode row: every token; a prompt's last chunk: its
last token; other slices: none, so no row of the output layer is computed for them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvboost_rag.attention_backends.spec import AttentionSpec
from kvboost_rag.hf.caches import BufferedCache, BufferedLayer
from kvboost_rag.attention_backends.ragged import ONE_CALL_MAX_TOKENS, in_one_call, last_tokens_attention, one_call_setting
from kvboost_rag.attention_backends.sparse import QueryPositions, attend, last_queries_weights

PACKED_ATTENTION = "kvboost_packed"
#: Most tokens of a segment whose attention runs as one product per K/V head (a verify row, a
#: short slice) on a CPU in float32; longer segments attend by blocks of queries.
LAST_TOKENS_MAX = 16
#: The packed rows a pass attends (``rows``) and the passes run (``calls``): the attention
#: function transformers calls takes no such argument, so the pass sets them around its
#: forward; thread-local so that passes on other threads keep their own.
_state = threading.local()


@dataclass(eq=False)
class Segment:
    """One run of tokens in a packed pass.

    Attributes:
        ids: ``[m]`` host token ids.
        positions: ``[m]`` host int64 positions, ascending. Each token's K/V is written at its
            position in ``cache``; the cache holds every position before the first (or, for a
            scattered run, every position of its prompt).
        cache: The sequence's K/V (a :class:`~kvboost_rag.hf.caches.BufferedCache`); its
            length becomes the last position plus one when that is longer.
        logits: Logits of this many of its last tokens are returned (``0``: none).
        record: Attention of this many of its last queries is recorded per layer (summed over
            them, mean over heads; ``0``: none): the attention repair's probe.
        record_layers: Layers recorded, from the first (``None``: all).
        decode: A decode or verify row (every token's logits wanted): its linear layers read
            what ``decode_weights`` says (:mod:`kvboost_rag.decode_weights.small_rows`); prompt work always
            reads the model's own weights.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    cache: BufferedCache
    logits: int = 0
    record: int = 0
    record_layers: int | None = None
    decode: bool = False

    def __len__(self) -> int:
        return int(self.ids.numel())


@dataclass
class SegmentOutput:
    """What a packed pass returns for one segment.

    Attributes:
        logits: ``[logits, vocab]`` float32 logits of its last tokens (``None`` when none were
            asked for).
        recorded: One ``[keys]`` float32 tensor per recorded layer (see :attr:`Segment.record`).
    """

    logits: torch.Tensor | None = None
    recorded: list[torch.Tensor] = field(default_factory=list)


@dataclass(eq=False)
class Run:
    """A segment's place in the pass and its positions in every form the layers read."""

    segment: Segment
    start: int
    stop: int
    positions: QueryPositions
    first: int
    last: int
    contiguous: bool
    index: torch.Tensor | None
    recorded: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, segment: Segment, start: int, device: torch.device) -> Run:
        positions = QueryPositions.of(segment.positions, device)
        first, last = positions.listed[0], positions.listed[-1]
        contiguous = last - first == len(positions.listed) - 1
        index = None if contiguous else positions.on_device
        return cls(segment, start, start + len(segment), positions, first, last, contiguous, index)


def packed_layout(segments: Sequence[Segment], device: torch.device) -> list[Run]:
    """Each segment's span of the pass's ``T`` tokens and its positions on ``device``.

    Raises:
        ValueError: A segment without tokens.
    """
    runs, start = [], 0
    for segment in segments:
        if not len(segment):
            raise ValueError("a packed pass segment needs at least one token")
        runs.append(Run.of(segment, start, device))
        start += len(segment)
    return runs


def logits_index(runs: Sequence[Run]) -> int | torch.Tensor:
    """What the model's ``logits_to_keep`` takes for every token whose logits are wanted: how
    many of the pass's last tokens, when they are those (a slice), else ``[k]`` host indexes
    into the pass's tokens."""
    wanted = [i for run in runs for i in range(run.stop - run.segment.logits, run.stop) if run.segment.logits]
    total = runs[-1].stop
    if wanted and wanted[0] == total - len(wanted) and wanted[-1] == total - 1:
        return len(wanted)  # consecutive: the pass's last tokens
    return torch.tensor(wanted, dtype=torch.long)


def split_outputs(runs: Sequence[Run], logits: torch.Tensor) -> list[SegmentOutput]:
    """The pass's ``[k, vocab]`` logits (of :func:`logits_index`'s tokens) and recorded
    attention, per segment."""
    outputs, offset = [], 0
    for run in runs:
        count = run.segment.logits
        rows = logits[offset : offset + count].float() if count else None
        offset += count
        outputs.append(SegmentOutput(rows, run.recorded))
    return outputs


class PackedLayer(DynamicLayer):
    """Layer ``i`` of a packed pass: writes each segment's new K/V into its own cache.

    Args:
        index: The decoder layer.
        runs: The segments of the pass, in order.
    """

    def __init__(self, index: int, runs: Sequence[Run]) -> None:
        super().__init__()
        self.index = index
        self.runs = list(runs)
        self.rows: list[BufferedLayer] = [run.segment.cache.layers[index] for run in self.runs]
        first = self.rows[0]
        self.dtype, self.device = first.dtype, first.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write each segment's slice of ``[1, kv_heads, T, dim]`` at its positions; the
        segments' whole K/V go to :func:`packed_attention`, the new states come back as they
        are."""
        keys, values = write_runs(self.runs, self.rows, key_states, value_states)
        _state.rows = (self.index, keys, values, self.runs)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max(row.get_seq_length() for row in self.rows)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class PackedCache(DynamicCache):
    """The segments' caches seen by the model as the cache of one sequence of ``T`` tokens.

    Args:
        runs: The segments of the pass (:func:`packed_layout`), each cache with the model's
            number of layers.
    """

    def __init__(self, runs: Sequence[Run]) -> None:
        super().__init__()
        self.layer_class_to_replicate = None  # the layers are set here, not grown by update()
        layers = len(runs[0].segment.cache.layers)
        self.layers = [PackedLayer(i, runs) for i in range(layers)]


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of each segment's queries over that segment's K/V (left by
    :meth:`PackedLayer.update`), causal by position.

    Args:
        module: The attention module (unused).
        query: ``[1, heads, T, dim]``: every segment's tokens end to end.
        key: The new keys only (each segment's whole K/V come from the cache's update).
        value: The new values only.
        attention_mask: Ignored; causality comes from the segments' positions.
        scaling: Softmax scale (default ``dim ** -0.5``).
        dropout: Must be 0 (inference only).
        **kwargs: ``sliding_window`` and ``softcap`` are honoured.

    Returns:
        ``([1, T, heads, dim], None)`` like transformers' SDPA function.
    """
    rows = getattr(_state, "rows", None)
    if rows is None or rows[3][-1].stop != query.shape[2]:
        raise RuntimeError("packed attention used outside a PackedCache pass")
    layer, keys, values, runs = rows
    _state.rows = None
    _state.calls = getattr(_state, "calls", 0) + 1
    spec = AttentionSpec.of_call(query, scaling, kwargs)
    return attend_runs(layer, query, keys, values, runs, spec).transpose(1, 2).contiguous(), None


def write_runs(
    runs: Sequence[Run], rows: Sequence[BufferedLayer], key_states: torch.Tensor, value_states: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Write each run's slice of ``[1, kv_heads, T, dim]`` new K/V at its positions in its
    cache layer (``rows``, in the runs' order); every run's whole K/V, as the layers hold it."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for run, row in zip(runs, rows):
        k, v = row.put(
            key_states[:, :, run.start : run.stop], value_states[:, :, run.start : run.stop], run.first, run.last, run.index
        )
        keys.append(k)
        values.append(v)
    return keys, values


def attend_runs(
    layer: int,
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    runs: Sequence[Run],
    spec: AttentionSpec,
) -> torch.Tensor:
    """Each run's queries (its span of ``query`` ``[1, heads, T, dim]``) over its own K/V,
    causal by position (the layer's ``spec``: scale, window, softcap), recording what a run
    asks to record in layer ``layer``; ``[1, heads, T, dim]``."""
    out = torch.empty_like(query)
    done = _short_rows_together(query, keys, values, runs, spec, out)
    for i, (run, k, v) in enumerate(zip(runs, keys, values)):
        q = query[:, :, run.start : run.stop]
        segment = run.segment
        if segment.record and (segment.record_layers is None or layer < segment.record_layers):
            count = min(segment.record, len(segment))
            run.recorded.append(last_queries_weights(q[:, :, -count:], k, run.positions, count, spec))
        if i not in done:
            out[:, :, run.start : run.stop] = _segment_attention(q, k, v, run, spec)
    return out


def _segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    run: Run,
    spec: AttentionSpec,
) -> torch.Tensor:
    """One segment's queries ``[1, heads, m, dim]`` over its keys, the kernel chosen by its
    shape: one product per K/V head for up to :data:`LAST_TOKENS_MAX` tokens that are the last
    of their keys (float32 on a CPU: a decode row too, where SDPA's CPU kernel took 1.1-2.7x as
    long on 2.4k-8k keys), one SDPA call for one token that sees every key before it elsewhere,
    else the sparse attention's backend (blocks of queries on a CPU)."""
    groups = query.shape[1] // key.shape[1]
    visible = run.last + 1  # no query sees a key past the last one's position
    key, value = key[:, :, :visible], value[:, :, :visible]
    every_key = spec.softcap is None and (spec.window is None or spec.window >= visible)
    m = query.shape[2]
    if every_key and run.contiguous and m <= LAST_TOKENS_MAX and query.device.type == "cpu" and query.dtype == torch.float32:
        return last_tokens_attention(query, key, value, spec.scale)
    if m == 1 and every_key:
        return F.scaled_dot_product_attention(query, key, value, scale=spec.scale, enable_gqa=groups > 1)
    return attend(query, key, value, run.positions, spec)


def _short_rows_together(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    runs: Sequence[Run],
    spec: AttentionSpec,
    out: torch.Tensor,
) -> set[int]:
    """Where one call pays (CUDA by default, see :func:`~kvboost_rag.attention_backends.ragged.one_call`),
    the short appended runs (decode and verify rows) attend in one padded SDPA call, written
    into ``out``; the indexes of the runs done."""
    if spec.softcap is not None:
        return set()
    short = [
        i for i, run in enumerate(runs)
        if run.contiguous and len(run.segment) <= LAST_TOKENS_MAX and run.last + 1 == keys[i].shape[-2]
    ]
    if len(short) < 2:
        return set()
    longest = max(keys[i].shape[-2] for i in short)
    enabled = one_call_setting()
    if enabled is None:
        enabled = query.device.type == "cuda" and len(short) * longest <= ONE_CALL_MAX_TOKENS
    if not enabled:
        return set()
    width = max(len(runs[i].segment) for i in short)
    counts = [len(runs[i].segment) for i in short]
    padded = query.new_empty((len(short), query.shape[1], width, query.shape[-1]))
    for b, i in enumerate(short):
        run = runs[i]
        padded[b, :, : counts[b]] = query[0, :, run.start : run.stop]
        padded[b, :, counts[b] :] = query[0, :, run.stop - 1 : run.stop]  # padding: never read back
    groups = query.shape[1] // keys[short[0]].shape[1]
    together = in_one_call(padded, [keys[i] for i in short], [values[i] for i in short], counts, spec, groups)
    for b, i in enumerate(short):
        run = runs[i]
        out[0, :, run.start : run.stop] = together[b, :, : counts[b]]
    return set(short)


def packed_positions(runs: Sequence[Run]) -> torch.Tensor:
    """``[1, T]`` host positions of the pass's tokens."""
    return torch.cat([run.segment.positions.view(-1) for run in runs]).view(1, -1)


def packed_ids(runs: Sequence[Run]) -> torch.Tensor:
    """``[1, T]`` host token ids of the pass."""
    return torch.cat([run.segment.ids.view(-1) for run in runs]).view(1, -1)


def attention_calls() -> int:
    """Calls of :func:`packed_attention` in this thread so far (a model whose attention does not
    go through transformers' attention interface never calls it)."""
    return getattr(_state, "calls", 0)
