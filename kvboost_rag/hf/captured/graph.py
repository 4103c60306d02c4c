"""One token bucket of a captured step: its input table, its compiled function, its CUDA graph.

A bucket owns a device ``int64`` table (:func:`~kvboost_rag.hf.captured.rows.pack_rows`'s rows
and columns) at a fixed address. A step copies the host's table into it (one copy, from
page-locked memory on CUDA: the host does not wait) and runs the compiled function over views
of it; on CUDA the function's kernels were captured once into a ``torch.cuda.CUDAGraph``, so a
step is one copy and one graph launch whatever the model's depth, and its logits land in the
graph's own output buffer. Compiling and capturing happen in :meth:`BucketGraph.warm`, called
when the engine prepares its captured steps, never on a request.

Compiled code comes from torch's on-disk caches when an earlier process built the same graphs
(inductor's FX graph cache and AOTAutograd's cache, both on by default, under
``TORCHINDUCTOR_CACHE_DIR``, which :func:`keep_compiled_code_in` points at the engine's cache
folder); :func:`compile_cache_counts` says how many were found there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.utils import counters

#: Environment variable naming the folder of inductor's on-disk caches (FX graphs, AOTAutograd,
#: and Triton's kernels under it).
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"

#: The compiled step: ``(tokens, positions, pool_rows, *first_keys) -> [bucket, vocab]`` logits.
StepFunction = Callable[..., torch.Tensor]


def keep_compiled_code_in(folder: Path) -> Path:
    """Keep torch's on-disk compile caches in ``folder`` for this process, unless the user
    chose a folder (``TORCHINDUCTOR_CACHE_DIR`` set to anything but torch's default, which
    importing torch's compiler writes there); returns the folder in use. torch's default is
    under the system's temp folder, which a reboot or a fresh container empties: a process
    there compiles every bucket again (tens of seconds each for an 8B model)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    os.environ[CACHE_DIR_ENV] = str(folder)
    return folder


def compile_cache_counts() -> tuple[int, int]:
    """``(hits, misses)`` of inductor's on-disk FX graph cache in this process so far."""
    inductor = counters["inductor"]
    return int(inductor["fxgraph_cache_hit"]), int(inductor["fxgraph_cache_miss"])


class BucketGraph:
    """The compiled step of one token bucket over a fixed input table.

    Args:
        fields: Rows of the input table.
        bucket: Tokens of the step (columns of the table).
        device: The model's device.
        cuda_graph: Capture the function's kernels in a CUDA graph (CUDA only).
        memory_pool: CUDA graph memory pool shared with the other buckets' graphs (steps never
            run at once, so their temporaries can share memory).
    """

    def __init__(
        self,
        fields: int,
        bucket: int,
        device: torch.device,
        cuda_graph: bool,
        memory_pool: tuple | None = None,
    ) -> None:
        self._function: StepFunction | None = None
        self.bucket = bucket
        self._device = device
        self._cuda_graph = cuda_graph and device.type == "cuda"
        self._memory_pool = memory_pool
        with torch.inference_mode(False):  # an ordinary tensor, as the pool: one kind of input every call
            #: The device input table; its address never changes.
            self.table = torch.zeros((fields, bucket), dtype=torch.int64, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._output: torch.Tensor | None = None
        #: Steps run so far (graph replays on CUDA).
        self.runs = 0

    def _call(self) -> torch.Tensor:
        return self._function(*self.table.unbind(0))

    def _load(self, host_table: torch.Tensor) -> None:
        if self._device.type == "cuda":
            # From page-locked memory the copy is queued and the host goes on; the caching
            # host allocator keeps the staging block until the copy ran.
            self.table.copy_(host_table.pin_memory(), non_blocking=True)
        else:
            self.table.copy_(host_table)

    def warm(self, function: StepFunction, host_table: torch.Tensor) -> None:
        """Take ``function`` as this bucket's step (built over :attr:`table`), compile it (a
        first call on ``host_table``, which must touch no slot: only padded tokens), and on
        CUDA capture it in a graph."""
        self._function = function
        self._load(host_table)
        if not self._cuda_graph:
            self._call()
            return
        with torch.cuda.device(self._device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compile, autotune and lazy initialization outside the capture
                for _ in range(2):
                    self._call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: work other threads do meanwhile (a prefill, a warm) is not captured
            with torch.cuda.graph(graph, pool=self._memory_pool, capture_error_mode="thread_local"):
                self._output = self._call()
        self._graph = graph

    def run(self, host_table: torch.Tensor) -> torch.Tensor:
        """One step over ``host_table`` (``[fields, bucket]`` int64 on the host).

        Returns:
            ``[bucket, vocab]`` float32 logits; on CUDA the graph's output buffer, valid until
            this bucket's next step.
        """
        self._load(host_table)
        self.runs += 1
        if self._graph is None:
            return self._call()
        with torch.cuda.device(self._device):
            self._graph.replay()
        return self._output
