"""Captured rows steps: decode, draft-verify and blend steps as compiled graphs.

:class:`CapturedRows` runs the new tokens of several rows (sequences in a
:class:`~kvboost_rag.hf.captured.pool.SlotPool`) through the model in one step: it writes
their K/V into their slots at their positions, runs attention of each new token over its own
slot up to its own position (:mod:`kvboost_rag.hf.captured.attention`), and returns the
logits of every new token (:class:`~kvboost_rag.hf.captured.rows.StepLogits`). The step is
one ``torch.compile`` graph per token bucket (``fullgraph``: no graph break), and on CUDA one
CUDA graph per bucket (:mod:`kvboost_rag.hf.captured.graph`): no host read, no allocation and
no Python between the input copy and the logits. Graphs are built by :meth:`CapturedRows.prepare`,
which the engine calls when it loads, never on a request: by default on a thread of their own,
smallest bucket first, each bucket used as soon as it is ready while the engine serves on the
eager path (a step of more tokens than the ready buckets hold is split over several, or runs
eagerly). The step runs a view of the model whose attention layers always call the captured
attention (:func:`~kvboost_rag.hf.attention_switch.model_with_attention`), so building it
never switches the attention of the model that requests use meanwhile.

The same step runs a blend pass (one row: the chosen and live tokens of a prompt stitched
into a slot, at their scattered positions, with ``last_logits``): their K/V replace the rows
at their positions and attention is causal by position, what the eager pass over an armed
cache computes. With ``record_queries`` every layer of such a step also writes the attention
of the step's last tokens over the pool into a fixed buffer (:meth:`CapturedRows.recorded`):
the attention repair's probe in one step.

What the caller keeps: each sequence's length (a host int; the slot holds positions
``0..length - 1``). After a step it keeps as many of a row's new tokens as it accepts and
moves its length on by that many; K/V written for rejected drafts stay in the slot past the
length and are overwritten by the next step before any query reads them.

Where a step cannot be captured (the model's attention does not go through transformers'
attention interface, a graph break, a failed compile), :meth:`CapturedRows.prepare` says so
(:attr:`CapturedRows.reason`) and the caller decodes on the eager path.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.hf.attention_switch import model_with_attention
from kvboost_rag.hf.captured.attention import ROWS_ATTENTION, AttentionRecord, PoolCache, missing_support, step_mask
from kvboost_rag.hf.captured.graph import BucketGraph, StepFunction, compile_cache_counts
from kvboost_rag.hf.captured.pool import Slot, SlotPool
from kvboost_rag.hf.captured.rows import FIELDS, POOL_ROWS, Row, StepLogits, pack_rows, token_bucket
from kvboost_rag.hf.caches import cache_keyword

if TYPE_CHECKING:
    from kvboost_rag.hf.adapter import ModelAdapter

logger = logging.getLogger(__name__)

CapturedMode = Literal["auto", "on", "off"]
#: Token buckets of a step by default: decode steps of up to 16 rows, or draft-verify steps of
#: fewer rows with several drafts each.
DEFAULT_TOKEN_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)
#: Compiled graphs of the step function allowed per process (one per bucket and model).
RECOMPILE_LIMIT = 64
_RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
#: Globals the steps keep no guard on: transformers' registry of the outputs each model class
#: can record, read by every model's ``forward``. Dynamo guards on its length, so a model of
#: any other class loaded later in the process (an embedding model, a second LLM) would fail
#: every bucket's guard and recompile it on the next request; a class's own entry is set when
#: the class is first built and never changes.
_UNGUARDED_GLOBALS = ("_CAN_RECORD_REGISTRY",)
#: Whether this torch takes a ``guard_filter_fn`` (2.7 on); before it, steps keep every guard.
_FILTERS_GUARDS = "guard_filter_fn" in inspect.signature(
    getattr(torch._dynamo.eval_frame, "_optimize", torch._dynamo.optimize)
).parameters


#: Set when the interpreter starts to exit: a build in the background stops after the bucket
#: it is on (its thread is not a daemon: Python joins it before tearing anything down).
_EXITING = threading.Event()
threading._register_atexit(_EXITING.set)  # noqa: SLF001 - what concurrent.futures uses to stop its workers


def _guards_to_keep(entries: Sequence) -> list[bool]:
    """Dynamo's ``guard_filter_fn``: every guard but those on :data:`_UNGUARDED_GLOBALS`."""
    return [not any(name in entry.name for name in _UNGUARDED_GLOBALS) for entry in entries]


def _compiling():
    """Dynamo's settings while a step may compile: room for every bucket of every model."""
    return torch._dynamo.config.patch(**{_RECOMPILE_LIMIT: RECOMPILE_LIMIT})


def captured_steps_wanted(mode: CapturedMode, device: torch.device) -> bool:
    """Whether captured steps are used: ``"on"``, ``"off"``, or ``"auto"``: on CUDA (one graph
    launch a step instead of a launch per kernel), not on a CPU (the first load there compiles
    for minutes, and eager steps over int8 copies decode faster; docs/benchmarks.md)."""
    if mode == "auto":
        return device.type == "cuda"
    return mode == "on"


def model_windows(config) -> tuple[int | None, ...]:
    """The sliding windows a model's attention layers may pass (``None``: global attention)."""
    window = getattr(config, "sliding_window", None) or None
    return (None,) if window is None else (None, int(window))


def _step_logits(
    model: torch.nn.Module,
    cache: PoolCache,
    keyword: str,
    windows: tuple[int | None, ...],
    pool: SlotPool,
    last_only: bool,
    record: torch.Tensor | None,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    pool_rows: torch.Tensor,
    first_key: torch.Tensor,
) -> torch.Tensor:
    """The step itself (what is compiled): ``[bucket]`` tokens at ``positions``, their K/V
    written at ``pool_rows`` (the rows ``cache`` writes at), each reading its slot from
    ``first_key``; returns ``[bucket, vocab]`` float32 logits, or with ``last_only`` the
    ``[1, vocab]`` logits of the last real token (the real tokens come first, the padded ones
    write into the scratch rows). With ``record`` (``[layers, pool tokens]``), every layer
    writes there the attention of the last ``record_queries`` real tokens (the row count of
    ``record``'s companion: see :class:`CapturedRows`)."""
    real = (pool_rows < pool.scratch_start).sum()
    keep: int | torch.Tensor = (real - 1).view(1) if last_only else 0
    mask = step_mask(pool_rows, first_key, windows, pool.total_tokens)
    if record is not None:
        weights, count = record
        queries = (real - count + torch.arange(count, device=real.device)).clamp_min(0)  # [count]
        mask.record = AttentionRecord(weights, queries, first_key[queries], pool_rows[queries])
    out = model(
        input_ids=tokens.view(1, -1),
        position_ids=positions.view(1, -1),
        attention_mask=mask,
        **{keyword: cache},
        use_cache=True,
        logits_to_keep=keep,
    )
    return out.logits[0].float()


class CapturedRows:
    """Steps of several rows over a slot pool, compiled and (on CUDA) captured per token bucket.

    Args:
        adapter: The model adapter (its ``model``, ``config``, ``device`` and ``features``).
        pool: The slot pool the rows live in (its scratch region holds the largest bucket).
        token_buckets: Token counts the step is built for (powers of two); a step runs the
            smallest bucket holding its rows' tokens.
        backend: ``torch.compile`` backend (``"inductor"``; tests use ``"aot_eager"``), or
            ``None`` to run the step uncompiled (for checks).
        cuda_graphs: Capture each bucket in a CUDA graph; default: on CUDA.
        last_logits: Steps of one row that return the logits of its last token only (a blend
            pass: its chosen tokens at scattered positions, the logits of the prompt's last
            token) instead of every token's.
        record_queries: With ``last_logits``, every step also records, per layer, the
            attention of its last ``record_queries`` tokens over the pool (the attention
            repair's probe: :meth:`recorded`); 0: nothing recorded.
        memory_pool: The CUDA graph memory pool (``torch.cuda.graph_pool_handle()``) its
            graphs share with other captured steps of the engine (they never run at once);
            default: a new one.

    Raises:
        InvalidInputError: A bucket that is not a power of two, or larger than the pool's
            scratch region.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        pool: SlotPool,
        token_buckets: Sequence[int] = DEFAULT_TOKEN_BUCKETS,
        backend: str | None = "inductor",
        cuda_graphs: bool | None = None,
        last_logits: bool = False,
        record_queries: int = 0,
        memory_pool: tuple | None = None,
    ) -> None:
        buckets = sorted(set(token_buckets))
        scratch = pool.total_tokens - pool.scratch_start
        if not buckets or any(b < 1 or b & (b - 1) or b > scratch for b in buckets):
            raise InvalidInputError(
                f"token buckets must be powers of two up to the pool's scratch rows ({scratch}), got {list(token_buckets)}"
            )
        self.adapter = adapter
        self.pool = pool
        self.buckets: tuple[int, ...] = tuple(buckets)
        self.windows = model_windows(adapter.config)
        self._backend = backend
        self._cuda_graphs = adapter.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.last_logits = last_logits
        if record_queries and not last_logits:
            raise InvalidInputError("only steps of one row that return the last logits record attention")
        self.record_queries = record_queries
        #: ``[layers, pool tokens]`` float32: the attention the last step recorded, per layer.
        self.record: torch.Tensor | None = None
        if record_queries:
            with torch.inference_mode(False):  # an ordinary tensor, as the pool
                self.record = torch.zeros(
                    (adapter.num_layers, pool.total_tokens), dtype=torch.float32, device=adapter.device
                )
        if memory_pool is None and self._cuda_graphs and adapter.device.type == "cuda":
            memory_pool = torch.cuda.graph_pool_handle()
        #: The CUDA graph memory pool of its graphs (``None`` without CUDA graphs).
        self.memory_pool = memory_pool
        self._graphs: dict[int, BucketGraph] = {}
        self._lock = threading.Lock()
        self._built = threading.Event()
        #: Why the steps are not available (empty once :meth:`prepare` succeeded).
        self.reason = "not prepared: call prepare()"

    @property
    def backend(self) -> str | None:
        """The ``torch.compile`` backend the steps are built with (``None``: uncompiled)."""
        return self._backend

    @property
    def available(self) -> bool:
        """Whether a bucket is ready (steps run now)."""
        return bool(self._ready())

    @property
    def ready_buckets(self) -> tuple[int, ...]:
        """The buckets built so far, smallest first."""
        return tuple(sorted(self._ready()))

    @property
    def max_tokens(self) -> int:
        """Most tokens (all rows together) one step runs now: the largest ready bucket (0
        while none is)."""
        return max(self._ready(), default=0)

    @property
    def fixed_tensors(self) -> list[torch.Tensor]:
        """The device tensors the steps read and write at fixed addresses: the pool's K and V,
        and each ready bucket's input table."""
        return [self.pool.keys, self.pool.values, *(graph.table for graph in self._ready().values())]

    @property
    def runs(self) -> int:
        """Steps run so far, all buckets together (CUDA graph replays on CUDA)."""
        return sum(graph.runs for graph in self._ready().values())

    def wait_until_built(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`prepare` is done with every bucket (built, or given up: see
        :attr:`reason`); whether it is within ``timeout`` seconds."""
        return self._built.wait(timeout)

    def _ready(self) -> dict[int, BucketGraph]:
        with self._lock:
            return dict(self._graphs)

    def _function(self, model: torch.nn.Module, pool_rows: torch.Tensor) -> StepFunction:
        """The step function of the bucket whose input table holds ``pool_rows``, over
        ``model`` (the view of the model with the captured attention)."""
        cache = PoolCache(self.pool, pool_rows)
        keyword, windows, pool, last_only = cache_keyword(model), self.windows, self.pool, self.last_logits
        record = None if self.record is None else (self.record, self.record_queries)

        def step(*table_rows: torch.Tensor) -> torch.Tensor:
            return _step_logits(model, cache, keyword, windows, pool, last_only, record, *table_rows)

        if self._backend is None:
            return step
        options = {"guard_filter_fn": _guards_to_keep} if _FILTERS_GUARDS else None
        return torch.compile(step, fullgraph=True, dynamic=False, backend=self._backend, options=options)

    def prepare(self, background: bool = False, after: CapturedRows | None = None) -> bool:
        """Build every bucket's graph (compile, and on CUDA capture) on padded tokens only (no
        slot is touched), smallest first.

        Args:
            background: Build on a thread of its own and return at once; each bucket is used
                as soon as it is ready (steps of a probe, which share one attention record,
                only once all are). The log says when each is.
            after: In the background, start once these steps are built (one compile at a
                time, the decode steps first).

        Returns:
            Whether the steps can be built (in the background: whether building started). If
            not, :attr:`reason` says why and the caller stays on the eager path.
        """
        self.reason = missing_support() or (
            "" if self.adapter.features.batched_decoding else self.adapter.features.batched_decoding_reason
        )
        view = None
        if not self.reason:
            try:
                view = model_with_attention(self.adapter.model, ROWS_ATTENTION)
            except ValueError as exc:
                self.reason = f"captured steps need the model's own forward code ({exc})"
        if view is None:
            logger.warning("%s; decoding stays on the eager path", self.reason)
            self._built.set()
            return False
        if background:
            threading.Thread(target=self._build_after, args=(view, after), name="kvboost-captured-build", daemon=False).start()
            return True
        return self._build_all(view, False)

    def _build_after(self, view: torch.nn.Module, after: CapturedRows | None) -> None:
        if after is not None:
            after.wait_until_built()
        self._build_all(view, background=True)

    def _build_all(self, view: torch.nn.Module, background: bool) -> bool:
        """Build the buckets over ``view``, publishing each as it is ready (all at once for
        steps that record attention); whether any is ready at the end."""
        started, (hits, misses) = time.perf_counter(), compile_cache_counts()
        held: dict[int, BucketGraph] = {}
        try:
            with torch.inference_mode(), _compiling():
                for bucket in self.buckets:
                    if background and _EXITING.is_set():
                        raise InterruptedError("the interpreter is exiting")
                    graph = BucketGraph(FIELDS, bucket, self.adapter.device, self._cuda_graphs, self.memory_pool)
                    graph.warm(self._function(view, graph.table[POOL_ROWS]), pack_rows([], bucket, self.pool.scratch_start))
                    held[bucket] = graph
                    if self.record is None:
                        self._publish(held)
                        if background:
                            logger.info("captured steps: bucket %d ready after %.1f s (%d of %d)",
                                        bucket, time.perf_counter() - started, len(held), len(self.buckets))
            self._publish(held)
            self.reason = ""
        except torch.OutOfMemoryError as exc:
            if not background:
                raise
            self._give_up(exc)
        except Exception as exc:  # noqa: BLE001 - any failure to build leaves the eager path in place
            self._give_up(exc)
        finally:
            self._built.set()
        now_hits, now_misses = compile_cache_counts()
        logger.info(
            "captured steps: %d buckets %s ready in %.1f s (compile cache: %d found, %d compiled)",
            len(self._ready()), list(self.ready_buckets), time.perf_counter() - started, now_hits - hits, now_misses - misses,
        )
        return self.available

    def _publish(self, graphs: dict[int, BucketGraph]) -> None:
        """Make ``graphs`` usable by :meth:`run`; the first decode bucket lets sequences take
        slots of the pool."""
        with self._lock:
            self._graphs.update(graphs)
        if graphs and not self.last_logits:
            self.pool.open()

    def _give_up(self, exc: BaseException) -> None:
        """Log why the buckets not built yet will not be (those ready stay in use)."""
        self.reason = f"captured steps could not be built ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
        tail = f"buckets {list(self.ready_buckets)} stay in use" if self.available else "decoding stays on the eager path"
        logger.warning("%s; %s", self.reason, tail)
        logger.debug("why captured steps could not be built", exc_info=exc)

    def recorded(self, slot: Slot, length: int) -> list[torch.Tensor]:
        """What the last step recorded over ``slot``'s first ``length`` rows: one ``[length]``
        float32 tensor per layer (copies), as the eager probe records them.

        Raises:
            RuntimeError: The steps record nothing (``record_queries`` 0).
        """
        if self.record is None:
            raise RuntimeError("these captured steps record no attention (record_queries=0)")
        return list(self.record[:, slot.start : slot.start + length].clone().unbind(0))

    @torch.inference_mode()
    def run(self, rows: Sequence[Row]) -> StepLogits:
        """One step over ``rows``: each row's tokens written at its positions in its slot and
        run causally over it; the logits of every token.

        One step at a time (the caller holds the model, as for any forward pass).

        Args:
            rows: One or more rows in distinct slots of this pool, at most :attr:`max_tokens`
                tokens in all.

        Returns:
            The step's logits (valid until the next step of the same bucket); with
            ``last_logits``, those of the row's last token only.

        Raises:
            InvalidInputError: Too many tokens, a row past its slot, two rows in one slot, a
                slot of another pool, several rows in a ``last_logits`` step.
            RuntimeError: :meth:`prepare` did not succeed.
        """
        graphs = self._ready()
        if not graphs:
            raise RuntimeError(f"captured steps are not available: {self.reason or 'no bucket is ready yet'}")
        if len({row.slot.index for row in rows}) != len(rows):
            raise InvalidInputError("two rows of one step share a slot")
        if any(row.slot.index >= len(self.pool.slots) or self.pool.slots[row.slot.index] != row.slot for row in rows):
            raise InvalidInputError("a row's slot is not one of this pool's")
        if self.last_logits and len(rows) != 1:
            raise InvalidInputError("a step that returns the last logits only runs one row")
        bucket = token_bucket(sum(len(row.tokens) for row in rows), tuple(graphs))
        if bucket is None or not rows:
            raise InvalidInputError(f"a step runs 1 to {max(graphs)} tokens: split the rows over several steps")
        table = pack_rows(rows, bucket, self.pool.scratch_start)
        # Without a CUDA graph, dynamo checks its guards on every call; one that no longer holds
        # (another model class loaded since, say) compiles the bucket again rather than fail.
        with _compiling():
            flat = graphs[bucket].run(table)
        return StepLogits(flat, (0,), (1,)) if self.last_logits else StepLogits.of(flat, rows)
