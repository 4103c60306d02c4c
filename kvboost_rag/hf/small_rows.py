"""The linear layers of decode and verify steps on a kernel made for a few rows.

A decode step feeds each sequence one token; a verify step the pending token and up to 15
drafted ones. Its linear layers (projections, MLPs, the logits) multiply a few rows by weights
that stream from memory once either way, so a step of 8 rows should cost about what a step of
one costs. On a CPU, torch's float32 ``F.linear`` (MKL ``sgemm``) does not behave so: measured
on a 2-core AMD EPYC, 2 threads, 2-16 rows cost 2-5x one row (the output layer of a
150k-token vocabulary: 31 ms for one row, 61-77 ms for 2-16). oneDNN's inner product over the
weights reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
the layout torch's compiler packs weights into) streams them at close to the memory's speed
whatever the rows: 10-15 ms for 1-16 rows of that layer, within float32 rounding of ``F.linear``.

Which kernel runs is chosen once per model when the engine loads (:func:`choose_kernel`):

- ``"packed"``: oneDNN over a copy of the weights in its blocked layout (the copy costs the
  weights' bytes again, so only while it fits the budget);
- ``"onednn"``: oneDNN over the model's own weights (no copy, less fast);
- ``"off"``: ``F.linear``, as the model itself runs.

``"auto"`` measures. Where oneDNN applies (a CPU, float32 ``nn.Linear`` layers with plain
weights, oneDNN in this torch build), the candidate (``"packed"``, or ``"onednn"`` when the
copy would not fit) must first compute what ``F.linear`` computes on the model's own layers,
then is timed against ``F.linear`` over the model's layers at 1 and 8 rows, on one thread, in
interleaved rounds, keeping the fastest pass of each; it is chosen only when it is nowhere
slower and the two together are :data:`MIN_GAIN` faster, so a choice that only noise favours
is not made. One thread measures the kernels' own work: with two, a pass waits for whichever
thread other work on the machine held up (on a shared 2-core VM the same choice, timed on two
threads four times, went three times to ``F.linear``, its 1-row pass timed at 25-130 ms; on one
thread it went four times to the packed copy, the passes within 15%), and the kernels keep
their standing on more threads (on two, quiet: 23 and 33 ms for ``F.linear`` at 1 and 8 rows,
12 and 13 ms for the packed copy; on one: 31 and 61, 17-20 and 23-27). On CUDA, with
16-bit or quantized weights, or without oneDNN, ``F.linear`` stays (the ``"auto"`` result is
``"off"``).

The chosen kernel runs only inside the engine's decode and verify steps, in the thread that
runs them (:meth:`SmallRowLinears.active`), for inputs of at most :data:`MAX_ROWS` rows:
prefill passes, and anything else that calls the model (``model.generate`` included), run
``F.linear`` over the model's own weights.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from kvboost_rag.hf.sparse_attention import thread_setting

logger = logging.getLogger(__name__)

SmallRowKernel = Literal["packed", "onednn", "off"]
#: Largest input (rows: tokens of all sequences of a step) the chosen kernel takes.
MAX_ROWS = 256
#: Batch size the packed layout is chosen for (oneDNN picks its blocking from it).
PACKED_FOR_ROWS = 16
#: Rows the candidates are timed at: a plain step and a verify step of 7 drafts.
TIMED_ROWS = (1, 8)
#: Interleaved timing rounds per candidate and row count (the fastest is kept).
ROUNDS = 3
#: How much faster (1 and 8 rows together) a kernel must be than ``F.linear`` to be chosen.
MIN_GAIN = 1.15
#: How much slower than ``F.linear`` a chosen kernel may be at any one timed row count (noise).
MAX_LOSS = 1.05
#: Weight bytes of the layers timed besides the largest (the first ones up to it): a pass over
#: more is as telling and costs more at load.
TIMED_BYTES = 256 * 2**20
#: Marks a ``forward`` this module installed (a second engine on the same model re-routes it).
ROUTED = "_kvboost_small_rows"
_state = threading.local()


def _product(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return run


def eligible_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's layers a small-row kernel can take: plain ``nn.Linear`` (no subclass, no
    hook that replaced its ``forward``) with float32 dense weights on the CPU."""
    found = []
    for module in model.modules():
        own = module.__dict__.get("forward")
        if type(module) is not torch.nn.Linear or hasattr(module, "_hf_hook"):
            continue
        if own is not None and not getattr(own, ROUTED, False):  # another library's forward
            continue
        weight = module.weight
        if type(weight) is not torch.nn.Parameter or weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        if weight.layout != torch.strided or weight.is_quantized or not weight.is_contiguous():
            continue
        found.append(module)
    return found


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its linear operators."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


@dataclass
class SmallRowLinears:
    """A model's linear layers with the kernel chosen for steps of a few rows.

    Attributes:
        kernel: What runs inside :meth:`active`.
        weights: Per layer, the weight the kernel reads (the packed copy, or the layer's own).
    """

    kernel: SmallRowKernel = "off"
    weights: dict[torch.nn.Linear, torch.Tensor] = field(default_factory=dict)

    def install(self) -> None:
        """Route the layers' calls through the kernel while :meth:`active` (once, at load)."""
        for module, weight in self.weights.items():
            routed = types.MethodType(_routed_forward(weight, module.bias), module)
            setattr(routed.__func__, ROUTED, True)
            module.forward = routed

    def restore(self) -> None:
        """Give the layers back their own ``forward`` and drop the packed copies."""
        for module in self.weights:
            module.__dict__.pop("forward", None)
        self.weights.clear()
        self.kernel = "off"

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within the block (this thread), the layers take inputs of up to :data:`MAX_ROWS`
        rows through the kernel."""
        with thread_setting(_state, "on", self.kernel != "off"):
            yield


def _routed_forward(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    run = _product(weight, bias)

    def forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if (
            getattr(_state, "on", False)
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.numel() <= MAX_ROWS * module.in_features
        ):
            return run(x)
        return F.linear(x, module.weight, module.bias)

    return forward


def choose_kernel(
    model: torch.nn.Module, setting: Literal["auto", "packed", "onednn", "off"], packed_bytes: int
) -> SmallRowLinears:
    """The kernel for a model's decode and verify steps, installed (see the module's doc).

    Args:
        model: The model (its layers' ``forward`` is routed when a kernel is chosen).
        setting: ``"auto"`` (measure), or the kernel to use where it applies.
        packed_bytes: Most bytes the packed copies may take (``"packed"`` is not a candidate
            beyond it).

    Returns:
        The layers and their kernel (``"off"``: nothing was changed).
    """
    modules = eligible_linears(model) if setting != "off" and onednn_available() else []
    for module in modules:  # routed by an earlier engine on this model: decided anew
        module.__dict__.pop("forward", None)
    if not modules:
        return SmallRowLinears()
    weight_bytes = sum(m.weight.numel() * 4 for m in modules)
    name: SmallRowKernel = "packed" if setting == "auto" else setting  # type: ignore[assignment]
    if name == "packed" and weight_bytes > packed_bytes:
        logger.info("small-row kernel: packed weights would take %d MiB (budget %d MiB)", weight_bytes >> 20, packed_bytes >> 20)
        name = "onednn" if setting == "auto" else "off"
    if name == "off":
        return SmallRowLinears()
    weights = _weights(name, modules)
    chosen = "off" if not _agrees(modules, weights) else _fastest(modules, name, weights) if setting == "auto" else name
    if chosen == "off":
        return SmallRowLinears()
    linears = SmallRowLinears(chosen, weights)
    linears.install()
    logger.info("small-row kernel for decode and verify steps: %s (%d layers)", chosen, len(modules))
    return linears


@torch.no_grad()
def _weights(name: SmallRowKernel, modules: Sequence[torch.nn.Linear]) -> dict[torch.nn.Linear, torch.Tensor]:
    if name == "packed":
        return {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACKED_FOR_ROWS) for m in modules}
    return {m: m.weight.detach() for m in modules}


@torch.inference_mode()
def _agrees(modules: Sequence[torch.nn.Linear], weights: dict[torch.nn.Linear, torch.Tensor]) -> bool:
    """Whether the kernel computes ``F.linear``'s result, to float32 rounding, on the largest
    layer and the first one, at 1 and :data:`PACKED_FOR_ROWS` rows."""
    generator = torch.Generator().manual_seed(0)
    largest = max(modules, key=lambda m: m.weight.numel())
    try:
        for module in {modules[0], largest}:
            for rows in (1, PACKED_FOR_ROWS):
                x = torch.randn(rows, module.in_features, generator=generator)
                expected = F.linear(x, module.weight, module.bias)
                got = _product(weights[module], module.bias)(x)
                scale = float(expected.abs().max()) + 1e-6
                if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * scale):
                    logger.warning("small-row kernel: oneDNN's result differs from F.linear's on this machine; not used")
                    return False
    except RuntimeError as exc:
        logger.warning("small-row kernel: oneDNN failed on this model (%s); not used", exc)
        return False
    return True


@torch.inference_mode()
def _fastest(
    modules: Sequence[torch.nn.Linear], name: SmallRowKernel, weights: dict[torch.nn.Linear, torch.Tensor]
) -> SmallRowKernel:
    """``name`` (over ``weights``) if it beats ``F.linear`` clearly (see :data:`MIN_GAIN`,
    :data:`MAX_LOSS`), else ``"off"``."""
    timed = _timed_modules(modules)
    passes: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "off": [_default(m) for m in timed],
        name: [_product(weights[m], m.bias) for m in timed],
    }
    inputs = {rows: [torch.randn(rows, m.in_features) for m in timed] for rows in TIMED_ROWS}
    seconds: dict[tuple[str, int], list[float]] = {(name, rows): [] for name in passes for rows in TIMED_ROWS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(ROUNDS + 1):  # the first round warms up and is not kept
            for name, calls in passes.items():
                for rows in TIMED_ROWS:
                    start = time.perf_counter()
                    for call, x in zip(calls, inputs[rows]):
                        call(x)
                    seconds[(name, rows)].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    fastest = {key: min(values[1:]) for key, values in seconds.items()}
    logger.info(
        "small-row kernels, ms at %s rows: %s",
        TIMED_ROWS,
        {name: [round(1000 * fastest[(name, rows)], 2) for rows in TIMED_ROWS] for name in passes},
    )
    return decide(fastest, [name])


def decide(seconds: dict[tuple[str, int], float], candidates: Sequence[SmallRowKernel]) -> SmallRowKernel:
    """The rule :func:`choose_kernel` applies to the timings: the candidate with the least
    time over :data:`TIMED_ROWS` together, if that is :data:`MIN_GAIN` less than
    ``F.linear``'s (``"off"``) and it is at most :data:`MAX_LOSS` slower at any of them.

    Args:
        seconds: Seconds of a pass by ``(kernel, rows)`` (the fastest of the rounds).
        candidates: The kernels timed besides ``"off"``.
    """
    best: SmallRowKernel = "off"
    best_total = sum(seconds[("off", rows)] for rows in TIMED_ROWS) / MIN_GAIN
    for name in candidates:
        total = sum(seconds[(name, rows)] for rows in TIMED_ROWS)
        nowhere_slower = all(seconds[(name, rows)] <= MAX_LOSS * seconds[("off", rows)] for rows in TIMED_ROWS)
        if nowhere_slower and total < best_total:
            best, best_total = name, total
    return best


def _default(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, module.weight, module.bias)


def _timed_modules(modules: Sequence[torch.nn.Linear]) -> list[torch.nn.Linear]:
    """The largest layer, and the first others up to :data:`TIMED_BYTES` of weights."""
    largest = max(modules, key=lambda m: m.weight.numel())
    timed, total = [largest], 0
    for module in modules:
        size = module.weight.numel() * 4
        if module is largest:
            continue
        if total + size > TIMED_BYTES:
            break
        timed.append(module)
        total += size
    return timed
