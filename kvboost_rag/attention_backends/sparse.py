"""Causal attention for a sparse set of query positions over a full-length cache.

The blend pass runs only chosen tokens (at scattered positions) against the K/V of every
prompt token, and a prefix hit runs the rest of the prompt on top of the cached prefix. In
both, causality comes from each query's absolute position: query ``i`` at position ``p_i``
sees keys ``0..p_i`` (or the last ``sliding_window`` of them). This attention function is
registered with transformers by :mod:`kvboost_rag.hf.attention_switch` and used only while
:func:`query_positions` is active. It has three interchangeable backends, equal to float
tolerance (``tests/test_attention.py``):

- ``"masked_sdpa"``: one ``scaled_dot_product_attention`` call per layer with a boolean
  ``[queries, keys]`` mask built from the positions (keys cut at the last query's position).
- ``"flex"``: one FlexAttention call per layer with a block mask built from the positions,
  so key blocks no query can see are skipped. Compiled on CUDA; on CPU it runs PyTorch's
  eager reference implementation.
- ``"blocks"``: a Python loop over blocks of 32 sorted queries, one SDPA call each, each
  block attending only to the keys up to its last position (the least arithmetic, the most
  kernel launches).

:func:`default_backend` picks per device and kind of queries. On CPU ``blocks`` for scattered
queries and ``masked_sdpa`` for consecutive ones, by measurement (``bench/attention_bench.py``,
1 thread, SmolLM2-135M head shapes: one masked SDPA call was 1.3-1.8x slower on blend passes
of 1k-8k tokens, since it computes every query against every key up to the last position;
eager FlexAttention 5-10x slower; on 2 threads a chunk of 64-256 consecutive queries at the
end of 1k-2.2k keys took 1.2-1.5x less time in one masked call than in blocks).
On CUDA ``flex`` (one compiled, block-sparse call per layer, no Python loop) where
FlexAttention is available, else ``masked_sdpa``; the first call compiles the kernel, and if
compiling fails the call is answered by ``masked_sdpa`` with a logged warning and
inputs of that kind (dtype, head size, grouping, window, softcap) use ``masked_sdpa`` from
then on (:func:`flex_failures`). :func:`use_backend` overrides the choice.

Within :func:`last_query_attention` every call also records the attention weights of its
last query (the prompt's last token), which the attention repair uses to choose the cached
tokens to recompute.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kvboost_rag.attention_backends.spec import AttentionSpec
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.transfer import host_to_device
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.thread_state import thread_setting

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

ATTENTION_NAME = "kvboost_sparse_causal"
Backend = Literal["masked_sdpa", "flex", "blocks"]
BACKENDS: tuple[str, ...] = ("masked_sdpa", "flex", "blocks")
_QUERY_BLOCK = 32
#: The pass's query positions and the attention it records (the probe): parameters of the
#: attention function transformers calls with its own arguments, so they ride as ambient
#: state, thread-local so that concurrent passes on other threads keep their own.
_state = threading.local()


@dataclass(frozen=True)
class QueryPositions:
    """The positions of one forward pass's queries, in every form the layers read them.

    Built once per forward, before the layer loop, so no layer copies or reads positions.

    Attributes:
        host: ``[queries]`` int64 on the host.
        listed: The same as Python ints (block bounds, key ranges).
        on_device: ``[queries]`` int64 on the model's device (masks), sent asynchronously.
    """

    host: torch.Tensor
    listed: list[int]
    on_device: torch.Tensor
    masks: dict[tuple, object] = field(default_factory=dict, compare=False)

    @property
    def contiguous(self) -> bool:
        """Whether the queries sit at consecutive positions (a chunk of a prompt, not the
        scattered tokens of a blend pass)."""
        return self.listed[-1] - self.listed[0] == len(self.listed) - 1

    @classmethod
    def of(cls, positions: torch.Tensor, device: torch.device | None = None) -> QueryPositions:
        """The positions ``[queries]`` (sorted) in every form, sent to ``device`` (default:
        where they are)."""
        host = positions.view(-1).to("cpu", torch.long)
        return cls(host, host.tolist(), host_to_device(host, device or host.device))


@contextlib.contextmanager
def query_positions(positions: torch.Tensor, device: torch.device | None = None) -> Iterator[None]:
    """Within the block, the registered attention treats queries as sitting at ``positions``.

    Args:
        positions: Sorted ``[queries]`` absolute positions of the tokens being run.
        device: The model's device (where the masks are built); default: the host.
    """
    _state.positions = QueryPositions.of(positions, device)
    try:
        yield
    finally:
        _state.positions = None


@contextlib.contextmanager
def last_query_attention(queries: int = 1) -> Iterator[list[torch.Tensor]]:
    """Within the block, sparse attention also records what its last queries attend to.

    Each layer's call appends a ``[keys]`` float32 tensor to the yielded list: the attention
    weights of the last query (the prompt's last token in a prefill) over every key, averaged
    over heads (zero beyond its position and outside its sliding window); with ``queries > 1``
    the sum of those of the last ``queries`` queries. Used to choose which reused tokens to
    recompute; the attention output itself is unchanged.

    Args:
        queries: How many of the last queries to record (at least 1).
    """
    recorded: list[torch.Tensor] = []
    _state.recorded = recorded
    _state.recorded_queries = max(1, queries)
    try:
        yield recorded
    finally:
        _state.recorded = None
        _state.recorded_queries = 1


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[None]:
    """Within the block (this thread), sparse attention uses ``backend``.

    Raises:
        InvalidInputError: ``backend`` is not one of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise InvalidInputError(f"attention backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    with thread_setting(_state, "backend", backend):
        yield


def default_backend(device: torch.device, contiguous: bool = False) -> Backend:
    """The backend for ``device``: ``flex`` on CUDA when FlexAttention is available (else
    ``masked_sdpa``); on a CPU ``masked_sdpa`` for queries at consecutive positions and
    ``blocks`` for scattered ones (the faster of each, as measured)."""
    if device.type == "cuda":
        return "flex" if _flex_functions() is not None else "masked_sdpa"
    return "masked_sdpa" if contiguous else "blocks"


def sparse_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of queries at sorted absolute positions over keys ``0..N-1``.

    Args:
        module: The attention module (unused).
        query: ``[batch, heads, queries, dim]``.
        key: ``[batch, kv_heads, N, dim]``.
        value: ``[batch, kv_heads, N, dim]``.
        attention_mask: Ignored; causality comes from the query positions.
        scaling: Softmax scale (default ``dim ** -0.5``).
        dropout: Must be 0 (inference only).
        **kwargs: ``sliding_window`` and ``softcap`` are honoured.

    Returns:
        ``([batch, queries, heads, dim], None)`` like transformers' SDPA function.
    """
    positions: QueryPositions | None = getattr(_state, "positions", None)
    if positions is None or len(positions.listed) != query.shape[2]:
        raise RuntimeError("sparse causal attention used outside query_positions()")
    spec = AttentionSpec.of_call(query, scaling, kwargs)
    recorded: list[torch.Tensor] | None = getattr(_state, "recorded", None)
    if recorded is not None:
        count = min(getattr(_state, "recorded_queries", 1), query.shape[2])
        recorded.append(last_queries_weights(query[:, :, -count:], key, positions, count, spec))
    out = attend(query, key, value, positions, spec)
    return out.transpose(1, 2).contiguous(), None


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: QueryPositions,
    spec: AttentionSpec,
) -> torch.Tensor:
    """Queries at sorted absolute ``positions`` over keys ``0..N-1``, causal by position, on
    the backend of this thread or device (see the module's doc).

    Args:
        query: ``[batch, heads, queries, dim]``.
        key: ``[batch, kv_heads, N, dim]``.
        value: ``[batch, kv_heads, N, dim]``.
        positions: The queries' positions.
        spec: The layer's scale, sliding window and softcap.

    Returns:
        ``[batch, heads, queries, dim]``.
    """
    backend = getattr(_state, "backend", None) or default_backend(query.device, positions.contiguous)
    if backend == "blocks":
        return attend_blocks(query, key, value, positions.listed, spec, positions.on_device)
    if backend == "flex":
        out = _flex(query, key, value, positions, spec)
        if out is not None:
            return out
    return _masked(query, key, value, positions, spec)


def last_queries_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: QueryPositions,
    count: int,
    spec: AttentionSpec,
) -> torch.Tensor:
    """``[N]`` attention weights of ``query``'s queries (the last ``count`` of ``positions``)
    over ``key``, mean over heads and batch rows, summed over the queries (zero beyond the last
    query's position and outside its sliding window)."""
    window, softcap = spec.window, spec.softcap
    last = positions.listed[-1]
    first = max(0, positions.listed[-count] - window + 1) if window else 0
    k = key[:, :, first : last + 1]  # [batch, kv_heads, keys, dim], a view: no copy of K
    batch, kv_heads = k.shape[:2]
    # [batch, kv_heads, groups, queries, dim]
    q = query.to(k.dtype).view(batch, kv_heads, -1, count, query.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2).unsqueeze(2)).float() * spec.scale  # [..., queries, keys]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if count > 1 or window:
        keys = torch.arange(first, last + 1, device=k.device).view(1, -1)
        pos = positions.on_device[-count:].view(-1, 1)
        visible = keys <= pos
        if window:
            visible &= keys > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.zeros(key.shape[2], dtype=torch.float32, device=key.device)
    weights[first : last + 1] = scores.softmax(dim=-1).mean(dim=(0, 1, 2)).sum(dim=0)
    return weights


# ---------------------------------------------------------------------- one masked SDPA call
def _key_range(positions: QueryPositions, window: int | None) -> tuple[int, int]:
    """Keys ``[first, last)`` any query can see."""
    last = positions.listed[-1] + 1
    first = max(0, positions.listed[0] - window + 1) if window else 0
    return first, last


def _allowed(positions: QueryPositions, first: int, last: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[queries, last - first]`` bool: which keys each query sees (built once per forward)."""
    cache = positions.masks
    tag = ("mask", first, last, window, device)
    if tag not in cache:
        keys = torch.arange(first, last, device=device).view(1, -1)
        pos = positions.on_device.view(-1, 1)
        allowed = keys <= pos
        if window:
            allowed &= keys > pos - window
        cache[tag] = allowed
    return cache[tag]


def _masked(query, key, value, positions: QueryPositions, spec: AttentionSpec) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    first, last = _key_range(positions, spec.window)
    allowed = _allowed(positions, first, last, spec.window, query.device)
    k, v = key[:, :, first:last], value[:, :, first:last]
    if spec.softcap:
        return _eager_softcap(query, k, v, allowed, spec, groups)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=spec.scale, enable_gqa=groups > 1)


# ---------------------------------------------------------------------- FlexAttention
_flex_lock = threading.Lock()
#: Inputs compiled FlexAttention could not be built for (dtype, head size, query heads per key
#: head, windowed, softcapped, device type): those calls use one masked SDPA call instead.
_flex_failed: set[tuple] = set()


def flex_failures() -> frozenset[tuple]:
    """The input kinds compiled FlexAttention failed to build for in this process (each then
    answered by one masked SDPA call per layer)."""
    with _flex_lock:
        return frozenset(_flex_failed)


#: Compiled graphs of the FlexAttention call allowed before torch falls back to eager: prompt
#: lengths are dynamic, so the variants are few (query and key block counts of one or more,
#: dtype, window, softcap), well under this.
FLEX_RECOMPILE_LIMIT = 64
_RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


@functools.cache
def _flex_functions(backend: str = "inductor") -> tuple[Callable, Callable, Callable] | None:
    """``(flex_attention eager, flex_attention compiled-or-None, create_block_mask)``; compiled
    with ``backend`` where CUDA is present, or wherever :func:`compile_flex_with` asks."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = None
    if torch.cuda.is_available() or backend != "inductor":
        compiled = torch.compile(flex_attention, dynamic=True, backend=backend)
    return flex_attention, compiled, create_block_mask


@functools.cache
def _softcap_score(softcap: float | None) -> Callable | None:
    """The score modification of a softcap (one function object per value, so compiled code is
    not specialized on a fresh closure at every call)."""
    if not softcap:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


@contextlib.contextmanager
def compile_flex_with(backend: str) -> Iterator[None]:
    """Within the block (this thread), the ``flex`` backend compiles with ``backend`` on every
    device, CPU included (``"aot_eager"`` traces and guards exactly as on a GPU without
    generating kernels: what tests of recompilation use)."""
    with thread_setting(_state, "flex_backend", backend):
        yield


def _flex_uses_compiled(device: torch.device) -> bool:
    """Whether FlexAttention runs compiled on ``device`` (CUDA, or any device within
    :func:`compile_flex_with`; elsewhere the eager reference)."""
    return device.type == "cuda" or getattr(_state, "flex_backend", None) is not None


def _flex(query, key, value, positions: QueryPositions, spec: AttentionSpec) -> torch.Tensor | None:
    """One FlexAttention call; ``None`` when the compiled kernel cannot be built (the caller
    then uses one masked SDPA call)."""
    functions = _flex_functions(getattr(_state, "flex_backend", None) or "inductor")
    if functions is None:
        raise InvalidInputError("attention backend 'flex' needs torch>=2.5 (FlexAttention); use 'masked_sdpa'")
    eager, compiled, create_block_mask = functions
    window, softcap = spec.window, spec.softcap
    first, last = _key_range(positions, window)
    k, v = key[:, :, first:last], value[:, :, first:last]
    device = query.device
    tag = ("flex", first, last, window, device)
    cache = positions.masks
    if tag not in cache:
        pos = positions.on_device - first

        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= pos[q_idx]
            if window:
                visible = visible & (kv_idx > pos[q_idx] - window)
            return visible

        cache[tag] = create_block_mask(mask_mod, None, None, query.shape[2], last - first, device=device)
    groups = query.shape[1] // key.shape[1]
    call = dict(score_mod=_softcap_score(softcap), block_mask=cache[tag], scale=spec.scale, enable_gqa=groups > 1)
    if compiled is None or not _flex_uses_compiled(device):
        return eager(query, k, v, **call)
    signature = (query.dtype, query.shape[-1], groups, window is not None, softcap is not None, device.type)
    with _flex_lock:
        failed_before = signature in _flex_failed
    if failed_before or _get_current_dispatch_mode() is not None:
        return None  # a known failure, or a dispatch mode (an op counter) torch.compile cannot run under
    try:
        with torch._dynamo.config.patch(**{_RECOMPILE_LIMIT: FLEX_RECOMPILE_LIMIT}):
            return compiled(query, k, v, **call)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ImportError) as exc:  # compilation failed (no Triton, no kernel for the shape...)
        with _flex_lock:
            _flex_failed.add(signature)
        _warnings.warning(
            f"flex-compile-{signature}",
            "compiled FlexAttention failed for %s (%s: %s); those calls use one masked SDPA call per layer",
            signature, type(exc).__name__, str(exc).splitlines()[0][:300],
        )
        return None


# ---------------------------------------------------------------------- loop over query blocks
def attend_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: list[int],
    spec: AttentionSpec,
    on_device: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries at sorted ``positions`` over keys ``0..N-1``, in blocks of 32 queries, each
    block attending only to the keys up to its last position (and within ``window``).

    Args:
        query: ``[batch, heads, queries, dim]``.
        key: ``[batch, kv_heads, N, dim]``.
        value: ``[batch, kv_heads, N, dim]``.
        positions: Absolute position of each query, ascending.
        spec: The layer's scale, sliding window and softcap.
        on_device: ``positions`` as a tensor on the queries' device (else each block's
            positions are copied there).

    Returns:
        ``[batch, heads, queries, dim]``.
    """
    groups, window = query.shape[1] // key.shape[1], spec.window
    out = torch.empty_like(query)
    for start in range(0, len(positions), _QUERY_BLOCK):
        end = min(start + _QUERY_BLOCK, len(positions))
        last = positions[end - 1] + 1
        first_key = max(0, positions[start] - window + 1) if window else 0
        keys = torch.arange(first_key, last, device=query.device)
        if on_device is not None:
            block_pos = on_device[start:end].view(-1, 1)
        else:
            block_pos = torch.tensor(positions[start:end], device=query.device).view(-1, 1)
        allowed = keys.view(1, -1) <= block_pos
        if window:
            allowed &= keys.view(1, -1) > block_pos - window
        k = key[:, :, first_key:last]
        v = value[:, :, first_key:last]
        q = query[:, :, start:end]
        if spec.softcap:
            out[:, :, start:end] = _eager_softcap(q, k, v, allowed, spec, groups)
        else:
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=spec.scale, enable_gqa=groups > 1
            )
    return out


def _eager_softcap(q, k, v, allowed, spec: AttentionSpec, groups: int) -> torch.Tensor:
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)

