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

Which kernel runs is chosen once per model when the engine loads (:func:`choose_kernel`), from
what decode should read (``decode_weights``) and then, for the model's own float32 weights, from
``small_row_kernels``:

- ``"int8"``: FBGEMM's dynamic quantized linear over an int8 copy of the weights with one scale
  per output channel, each row's activations rounded to 8 bits (:mod:`kvboost_rag.decode_weights.int8_rows`):
  a quarter of the float32 bytes read per step, and the copy costs a quarter of the weights'
  bytes, not the whole again;
- ``"packed"``: oneDNN over a copy of the weights in its blocked layout (the copy costs the
  weights' bytes again, so only while it fits the budget);
- ``"onednn"``: oneDNN over the model's own weights (no copy, less fast);
- ``"off"``: ``F.linear``, as the model itself runs.

Apart from that kernel, with ``decode_weights="stored"``, and wherever decode reads int8, the
layers whose float32 weights are 4-bit runs (a GGUF file's Q4 tensors) read them as stored at
every row count (:mod:`kvboost_rag.decode_weights.four_bit_groups`, checked against ``F.linear`` as the others
are); the kernel above is chosen for the rest. Not by default on other models: decode steps on
rounded activations turn the float32 rounding differences between reuse paths (a prefix hit's
tail against full prefill) into logit differences of ~0.1, so the embedded model's decode steps
would no longer match full prefill's to 1e-3. Every kernel here
computes each row on its own and the short rows' attention
(:func:`~kvboost_rag.attention_backends.ragged.last_tokens_attention`) each token as it would alone,
so a verify step's tokens get the logits one-token steps would give (bitwise where every layer
reads int8 or 4-bit runs; within float32 rounding of a float32 output layer otherwise): drafts
change how long an answer takes, not its tokens.

The choice is a rule over facts of the model, its dtype, the device and the torch build, never a
timing taken at load (timed at load, the choice flipped between starts of the same model on the
same idle machine, so decode speed changed from one start to the next):

- ``decode_weights="auto"`` reads int8 only for the models whose int8 answers were measured
  equal to their own (:data:`INT8_BY_DEFAULT`, figures in docs/benchmarks.md); ``"int8"``
  wherever the kernel applies (a CPU with AVX2 or AVX-512, float32 ``nn.Linear`` layers);
- ``small_row_kernels="auto"`` (when decode reads the model's own weights) is ``"packed"`` where
  oneDNN applies, the layers' weights are at least :data:`PACKED_MIN_BYTES` (below it oneDNN's
  call costs more than such layers' product) and the copy fits ``packed_weights_bytes``; else
  ``"off"``. On Intel CPUs the oneDNN kernels take steps of more than
  :data:`OWN_PRODUCT_ROWS_ON_INTEL` rows only: MKL's own float32 product of one or two rows
  reads the weights at the memory's speed there.

A candidate must first compute what ``F.linear`` computes on the model's own layers (float32
rounding for oneDNN; the int8 rounding bound for int8), or ``F.linear`` stays. Measured on two
machines (docs/benchmarks.md): on a 2-core AMD EPYC the packed copy took 12-13 ms for 1-8
rows of the embedded model's output layer where ``F.linear`` took 23-33 ms; on a 2-core Intel
Xeon (AVX-512), over all of Qwen2.5 0.5B's layers on 2 threads (``bench/int8_kernels.py``),
``F.linear`` took 84.5 / 148.3 / 201.4 / 190.9 ms at 1 / 4 / 8 / 16 rows, the packed copy 101.7 /
114.0 / 131.8 / 160.0, int8 45.0 / 61.4 / 71.6 / 90.5.

The chosen kernel runs only on the decode and verify rows of the engine's steps, at most
:data:`MAX_ROWS` of them, through a view of the model (:attr:`SmallRowLinears.view`: its module
tree copied, sharing every weight, each routed layer's copy calling its kernel): the user's own
modules are never changed, so anything else that calls the model (``model.generate`` included)
runs it as it was. Within a pass through the view (:meth:`SmallRowLinears.active`) the prompt
work it carries beside the decode rows (a prefill slice, the tokens after a prefix hit, the
repair's passes, a document being warmed) runs ``F.linear`` over the model's own weights, so
reuse stays exact whatever decode reads.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from kvboost_rag.decode_weights.four_bit_groups import FourBitLinear, four_bit_linears
from kvboost_rag.decode_weights.int8_rows import Int8Linear, dequantize_rows, int8_available, int8_linear, quantize_rows
from kvboost_rag.decode_weights.int8_siblings import SiblingProduct, fused_int8, sibling_groups
from kvboost_rag.decode_weights.stored_int8 import stored_int8_linears
from kvboost_rag.module_views import shared_copy
from kvboost_rag.thread_state import thread_setting

logger = logging.getLogger(__name__)

SmallRowKernel = Literal["int8", "packed", "onednn", "off"]
DecodeWeights = Literal["auto", "model", "int8", "stored"]
#: Largest input (rows: tokens of all sequences of a step) the chosen kernel takes.
MAX_ROWS = 256
#: Batch size the packed layout is chosen for (oneDNN picks its blocking from it).
PACKED_FOR_ROWS = 16
#: Least float32 weight bytes of the layers for which ``"auto"`` packs them (tiny models' layers
#: cost less through ``F.linear`` than oneDNN's call).
PACKED_MIN_BYTES = 64 * 2**20
#: Rows up to which, on Intel CPUs, steps over the model's own float32 weights keep ``F.linear``
#: instead of oneDNN: one pass over all the embedded model's layers on a 2-core Intel Xeon, 2
#: threads, took 26.2 / 27.3 / 34.5 / 65.1 ms at 1 / 2 / 4 / 8 rows through ``F.linear`` and
#: 35.1 / 32.6 / 33.0 / 56.9 ms packed (Qwen2.5 0.5B's whole step: 146 against 172 ms at one
#: row); on a 2-core AMD EPYC the packed copy was faster at every row count (MKL, under
#: ``F.linear``, does not run its fastest code on AMD CPUs).
OWN_PRODUCT_ROWS_ON_INTEL = 2
#: Output channels of a layer on which the int8 kernel's result is checked at load.
AGREEMENT_ROWS = 512
#: The models ``decode_weights="auto"`` decodes on int8 weights: ``(model_type, hidden_size,
#: num_hidden_layers, vocab_size)`` of the models whose int8 greedy answers equalled their own up
#: to the first near tie on at least 95% of the quality bench's prompts with a median per-step
#: next-token KL of at most 0.001 (``bench/int8_quality.py``; docs/benchmarks.md).
INT8_BY_DEFAULT: frozenset[tuple[str, int, int, int]] = frozenset({("qwen2", 896, 24, 151936)})
#: How many of this thread's pass's rows are decode rows (``rows``) and the input held between
#: the split head's two products (``head``): the routed ``forward`` of the decode view is
#: called by the model's own modules with ``forward``'s arguments only, so the pass sets these
#: around it; thread-local so that passes on other threads keep their own.
_state = threading.local()


def _product(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return run


def plain_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's plain ``nn.Linear`` layers: no subclass, no accelerate hook, no ``forward``
    another library put in place of theirs."""
    return [
        module for module in model.modules()
        if type(module) is torch.nn.Linear and not hasattr(module, "_hf_hook") and "forward" not in vars(module)
    ]


def eligible_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The model's layers a small-row kernel can take: :func:`plain_linears` with float32 dense
    weights on the CPU."""
    return [module for module in plain_linears(model) if _dense_float32(module.weight)]


def _dense_float32(weight: torch.Tensor) -> bool:
    """Whether a layer's weight is a float32 dense parameter on the CPU, contiguous."""
    if type(weight) is not torch.nn.Parameter or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return weight.layout == torch.strided and not weight.is_quantized and weight.is_contiguous()


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
        weights: Per layer, the weight the kernel reads: the packed copy or the layer's own
            weight (a tensor), or the int8 copy (:func:`~kvboost_rag.decode_weights.int8_rows.int8_linear`,
            its own product).
        copy_bytes: Bytes of the weight copies this holds besides the model's own weights (the
            int8 or packed copies; 0 when it reads the model's own).
        min_rows: Fewest rows the kernel takes; smaller inputs keep the layers' own product
            (:func:`float_kernel_min_rows`).
        four_bit: The layers whose weights are 4-bit runs, read as stored at every row count
            (:mod:`kvboost_rag.decode_weights.four_bit_groups`); not in :attr:`weights`, their copies'
            bytes in :attr:`copy_bytes`.
        view: The model as decode and verify steps run it (:meth:`install`): a view of its
            module tree sharing every weight, whose routed layers call their kernel; the
            user's own modules are never changed. ``None`` until installed, or nothing routed.
    """

    kernel: SmallRowKernel = "off"
    weights: dict[torch.nn.Linear, torch.Tensor | Int8Linear | SiblingProduct] = field(default_factory=dict)
    copy_bytes: int = 0
    min_rows: int = 1
    four_bit: dict[torch.nn.Linear, FourBitLinear | SiblingProduct] = field(default_factory=dict)
    view: torch.nn.Module | None = None
    _copies: dict[torch.nn.Module, torch.nn.Module] = field(default_factory=dict, repr=False)

    @property
    def routed(self) -> bool:
        """Whether any layer runs a kernel of its own in decode and verify steps."""
        return self.kernel != "off" or bool(self.four_bit)

    @property
    def rounds_activations(self) -> bool:
        """Whether decode and verify steps round activations (8-bit int8 rows, bfloat16 4-bit
        runs): float32 rounding differences in their inputs can then flip a rounding step and
        grow to logit differences of ~0.1."""
        return self.kernel == "int8" or bool(self.four_bit)

    def product(self, module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel's product for one of the layers (``x -> x @ W.T + b``)."""
        weight = self.weights[module]
        if not isinstance(weight, torch.Tensor):
            return weight
        return _product(weight, module.bias)

    def routes(self) -> dict[torch.nn.Linear, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
        """Each routed layer's product and the fewest rows it takes (none when nothing is
        routed): the kernel's from :attr:`min_rows`, the 4-bit runs' from one row."""
        if not self.routed:
            return {}
        routes = {module: (self.product(module), self.min_rows) for module in self.weights}
        routes.update((module, (product, 1)) for module, product in self.four_bit.items())
        return routes

    def install(self, model: torch.nn.Module) -> bool:
        """Build :attr:`view`: ``model``'s module tree shared, each routed layer's copy calling
        its kernel for the decode rows of a pass within :meth:`active` (once, at load).

        Returns:
            Whether the view was built; where a module of ``model`` overrides ``forward`` on
            the instance (a dispatch hook), nothing is routed (:meth:`restore`).
        """
        routes = self.routes()
        copies: dict[torch.nn.Module, torch.nn.Module] = {}

        def route(module: torch.nn.Module, copied: torch.nn.Module) -> None:
            copies[module] = copied
            if module in routes:
                copied.forward = types.MethodType(_routed_forward(*routes[module]), copied)

        try:
            # Hook tables shared: a hook the user puts on the model later runs in decode steps too.
            self.view = shared_copy(model, route, own_hooks=False) if routes else None
        except ValueError as exc:
            logger.info("small-row kernel not used: %s", exc)
            self.restore()
            return False
        self._copies = copies
        return self.view is not None

    def in_view(self, module: torch.nn.Module) -> torch.nn.Module:
        """The view's copy of one of the model's modules (what decode steps call)."""
        return self._copies[module]

    def restore(self) -> None:
        """Drop the view and the copies (the model's own modules were never changed)."""
        self.view = None
        self._copies = {}
        self.weights.clear()
        self.four_bit.clear()
        self.copy_bytes = 0
        self.kernel = "off"

    @contextmanager
    def active(self, decode_rows: int | None = None) -> Iterator[None]:
        """Within the block (this thread), the layers of :attr:`view` take decode and verify
        rows of up to :data:`MAX_ROWS` through the kernel.

        Args:
            decode_rows: How many of each layer input's first rows are decode and verify rows
                (a packed pass's decode segments come first); the rows after them (prompt work)
                read the model's own weights. ``None``: every row.
        """
        with thread_setting(_state, "rows", decode_rows):
            try:
                yield
            finally:
                _state.head = None  # the last input split in two (see _decode_head)


def _routed_forward(
    run: Callable[[torch.Tensor], torch.Tensor], min_rows: int
) -> Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]:
    def forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // module.in_features
        decode = getattr(_state, "rows", None)
        decode = rows if decode is None else min(decode, rows)
        if not kernel_takes(x, decode, min_rows):
            return F.linear(x, module.weight, module.bias)
        if decode == rows:
            return run(x)
        flat = x.reshape(rows, module.in_features)
        head = run(_decode_head(x, flat, decode))
        tail = F.linear(flat[decode:], module.weight, module.bias)
        return torch.cat([head, tail]).view(*x.shape[:-1], module.out_features)

    return forward


def kernel_takes(x: torch.Tensor, rows: int, min_rows: int) -> bool:
    """Whether a routed layer's kernel takes ``rows`` decode rows of ``x``: float32 on the CPU,
    from ``min_rows`` to :data:`MAX_ROWS` rows (else the layer's own ``F.linear``)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and min_rows <= rows <= MAX_ROWS


def _decode_head(x: torch.Tensor, flat: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``x``, the same tensor for every layer called on ``x`` (so
    the layers that read one input share one product, :mod:`kvboost_rag.decode_weights.int8_siblings`);
    held until the next split or the end of :meth:`SmallRowLinears.active`."""
    held = getattr(_state, "head", None)
    if held is None or held[0] is not x or held[1].shape[0] != rows:
        held = (x, flat[:rows])
        _state.head = held
    return held[1]


def model_key(model: torch.nn.Module) -> tuple[str, int, int, int]:
    """What :data:`INT8_BY_DEFAULT` knows a model by: its config's type and sizes."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (
        str(getattr(text, "model_type", "")),
        int(getattr(text, "hidden_size", 0) or 0),
        int(getattr(text, "num_hidden_layers", 0) or 0),
        int(getattr(text, "vocab_size", 0) or 0),
    )


def decode_reads(model: torch.nn.Module, decode_weights: DecodeWeights) -> Literal["model", "int8"]:
    """What decode and verify steps read under ``decode_weights`` (besides 4-bit runs), where
    the kernels apply: ``"int8"`` needs the int8 kernel
    (:func:`~kvboost_rag.decode_weights.int8_rows.int8_available`); ``"auto"`` is ``"int8"`` only for the
    models of :data:`INT8_BY_DEFAULT`; ``"stored"`` and ``"model"`` are ``"model"``."""
    if decode_weights in ("model", "stored") or not int8_available():
        return "model"
    if decode_weights == "auto" and model_key(model) not in INT8_BY_DEFAULT:
        return "model"
    return "int8"


def choose_kernel(
    model: torch.nn.Module,
    setting: Literal["auto", "packed", "onednn", "off"],
    packed_bytes: int,
    decode_weights: DecodeWeights = "model",
) -> SmallRowLinears:
    """The kernel for a model's decode and verify steps, installed (see the module's doc).

    The same model, settings and torch build give the same kernel on every call: nothing is
    timed.

    Args:
        model: The model (never changed: decode runs a view of it, :attr:`SmallRowLinears.view`).
        setting: The kernel over the model's own float32 weights: ``"auto"`` (the rule in the
            module's doc), or the kernel to use where it applies.
        packed_bytes: Most bytes the packed copies may take (``"packed"`` is not used beyond it).
        decode_weights: What decode reads: ``"model"`` (its own float32 weights, through
            ``setting``'s kernel), ``"int8"`` (an int8 copy), ``"auto"`` (:func:`decode_reads`),
            ``"stored"`` (the layers whose weights are 4-bit runs read as stored,
            :mod:`kvboost_rag.decode_weights.four_bit_groups`, the others as ``"model"``); wherever decode
            reads int8, the 4-bit runs are read as stored too, and the layers a model already
            holds as int8 (:mod:`kvboost_rag.decode_weights.stored_int8`) are read from their own values.

    Returns:
        The layers and their kernel (``"off"`` and no 4-bit layers: nothing was changed).
    """
    plain = plain_linears(model)
    eligible = [module for module in plain if _dense_float32(module.weight)]  # eligible_linears, one walk
    stored = stored_int8_linears(plain)
    reads = decode_reads(model, decode_weights)
    if stored and reads != "int8" and int8_available():
        logger.info(
            "%d layers are stored as int8 (torchao); decode runs their own forward (decode_weights='int8' reads their values "
            "through the int8 kernel)",
            len(stored),
        )
    four_bit = _four_bit_copies(model, eligible) if decode_weights == "stored" or reads == "int8" else {}
    rest = [module for module in eligible if module not in four_bit]
    chosen = _rest_kernel(model, rest, stored, setting, packed_bytes, reads)
    chosen.four_bit = four_bit
    chosen.copy_bytes += sum(copy.nbytes for copy in four_bit.values())
    return _installed(model, chosen, len(eligible) + len(stored))


def _four_bit_copies(model: torch.nn.Module, eligible: Sequence[torch.nn.Linear]) -> dict[torch.nn.Linear, FourBitLinear | SiblingProduct]:
    """The 4-bit copies of the layers stored as 4-bit runs, if the kernel computes what the
    layers compute (checked on the first of them and the largest)."""
    try:
        copies = four_bit_linears(model, eligible)
    except RuntimeError as exc:  # the kernel's packing refused a layer
        logger.warning("small-row kernel: the 4-bit kernel failed on this model (%s); not used", exc)
        return {}
    if not copies:
        return {}
    layers = list(copies)
    agrees = _kernel_agrees(layers, partial(_four_bit_agrees_on, copies), "the 4-bit kernel")
    _forget_probe_outputs(copies, _probed_layers(layers))
    return copies if agrees else {}


def _rest_kernel(
    model: torch.nn.Module,
    modules: list[torch.nn.Linear],
    stored: dict[torch.nn.Linear, tuple[torch.Tensor, torch.Tensor]],
    setting: str,
    packed_bytes: int,
    reads: Literal["model", "int8"],
) -> SmallRowLinears:
    """The kernel of the layers not read as 4-bit runs (not installed): ``modules`` (float32
    weights) and ``stored`` (int8 already, which only the int8 kernel reads)."""
    if reads == "int8" and (modules or stored):
        chosen = _int8_linears(model, [*modules, *stored], stored)
        if chosen.kernel == "int8" or not onednn_available() or setting == "off":
            return chosen
    if not modules or setting == "off" or not onednn_available():
        return SmallRowLinears()
    weight_bytes = sum(m.weight.numel() * 4 for m in modules)
    name: SmallRowKernel = setting  # type: ignore[assignment]
    if setting == "auto":
        name = "packed" if PACKED_MIN_BYTES <= weight_bytes <= packed_bytes else "off"
    elif name == "packed" and weight_bytes > packed_bytes:
        logger.info("small-row kernel: packed weights would take %d MiB (budget %d MiB)", weight_bytes >> 20, packed_bytes >> 20)
        name = "off"
    if name == "off":
        return SmallRowLinears()
    weights = _weights(name, modules)
    if not _kernel_agrees(modules, partial(_onednn_agrees_on, weights), "oneDNN"):
        return SmallRowLinears()
    copy = sum(w.numel() * w.element_size() for w in weights.values()) if name == "packed" else 0
    return SmallRowLinears(name, weights, copy_bytes=copy, min_rows=float_kernel_min_rows())


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``, ...;
    ``""`` where there is none)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    return value.strip()
    except OSError:
        pass
    return ""


def float_kernel_min_rows(vendor: str | None = None) -> int:
    """Fewest rows the oneDNN kernels take over float32 weights: on Intel CPUs
    (:data:`OWN_PRODUCT_ROWS_ON_INTEL`), MKL's own product of so few rows reads the weights at
    the memory's speed and is the faster; elsewhere the oneDNN kernel takes every row count."""
    vendor = cpu_vendor() if vendor is None else vendor
    return OWN_PRODUCT_ROWS_ON_INTEL + 1 if vendor == "GenuineIntel" else 1


def _installed(model: torch.nn.Module, linears: SmallRowLinears, layers: int) -> SmallRowLinears:
    if linears.routed and linears.install(model):
        logger.info(
            "small-row kernel for decode and verify steps: %d of %d layers read as stored 4-bit runs, the others %s "
            "from %d rows (copies %d MiB)",
            len(linears.four_bit),
            layers,
            linears.kernel,
            linears.min_rows,
            linears.copy_bytes >> 20,
        )
    return linears


@torch.no_grad()
def _int8_linears(
    model: torch.nn.Module, modules: Sequence[torch.nn.Linear], stored: dict[torch.nn.Linear, tuple[torch.Tensor, torch.Tensor]]
) -> SmallRowLinears:
    """Int8 copies of the layers' weights, the layers that read one input fused
    (:mod:`kvboost_rag.decode_weights.int8_siblings`), if the kernel computes what they should (checked on
    the first :data:`AGREEMENT_ROWS` output channels of the probed layers: no whole-layer
    float32 temporaries). A layer in ``stored`` (:func:`~kvboost_rag.decode_weights.stored_int8.stored_int8_linears`)
    gives its own int8 values and scales; the others' float32 weights are quantized."""

    def int8_values(module: torch.nn.Linear, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if module in stored:
            q, scales = stored[module]
            return q[:rows], scales[:rows]
        return quantize_rows(module.weight[:rows])  # rows quantize alone

    probed = _probed_layers(modules)
    groups = sibling_groups(model, modules)
    fused = {layer: product for group in groups for layer, product in zip(group, fused_int8(group, int8_values))}
    weights: dict[torch.nn.Linear, torch.Tensor | Int8Linear | SiblingProduct] = {
        module: fused.get(module) or int8_linear(*int8_values(module), module.bias) for module in modules
    }
    checked = {module: dequantize_rows(*int8_values(module, AGREEMENT_ROWS)) for module in probed}
    linears = SmallRowLinears("int8", weights, sum(w.nbytes for w in weights.values()))  # type: ignore[union-attr]
    agrees = _kernel_agrees(modules, partial(_int8_agrees_on, linears, checked), "the int8 kernel")
    _forget_probe_outputs(weights, probed)
    return linears if agrees else SmallRowLinears()


def _forget_probe_outputs(copies: dict, probed: Sequence[torch.nn.Linear]) -> None:
    """Drop the outputs the load-time probes left held by the probed layers' fused groups."""
    for module in probed:
        if isinstance(copies[module], SiblingProduct):
            copies[module].shared.forget()


def _probed_layers(modules: Sequence[torch.nn.Linear]) -> list[torch.nn.Linear]:
    """The layers a kernel is checked on: the first and the largest, in that order."""
    largest = max(modules, key=lambda m: m.in_features * m.out_features)
    return [modules[0]] if largest is modules[0] else [modules[0], largest]


def _probe_inputs(modules: Sequence[torch.nn.Linear]) -> Iterator[tuple[torch.nn.Linear, torch.Tensor]]:
    """``(layer, input)`` pairs a kernel is checked on: :func:`_probed_layers` at 1 and
    :data:`PACKED_FOR_ROWS` rows (inputs from a fixed seed, in a fixed order)."""
    generator = torch.Generator().manual_seed(0)
    for module in _probed_layers(modules):
        for rows in (1, PACKED_FOR_ROWS):
            yield module, torch.randn(rows, module.in_features, generator=generator)


@torch.inference_mode()
def _kernel_agrees(
    modules: Sequence[torch.nn.Linear], agrees_on: Callable[[torch.nn.Linear, torch.Tensor], bool], kernel: str
) -> bool:
    """Whether ``agrees_on(layer, input)`` holds for every probe input (:func:`_probe_inputs`);
    a kernel that disagrees or fails is logged and not used."""
    try:
        for module, x in _probe_inputs(modules):
            if not agrees_on(module, x):
                logger.warning("small-row kernel: %s's result is off on this machine; not used", kernel)
                return False
    except RuntimeError as exc:
        logger.warning("small-row kernel: %s failed on this model (%s); not used", kernel, exc)
        return False
    return True


def _four_bit_agrees_on(
    copies: dict[torch.nn.Linear, FourBitLinear | SiblingProduct], module: torch.nn.Linear, x: torch.Tensor
) -> bool:
    """Whether the 4-bit kernel computes ``F.linear`` over the layer's own weight for ``x``,
    within the bound the bfloat16 rounding allows (the runs are the weight's own values)."""
    return _within_copy_rounding(copies[module], module.weight, module.bias, x)


def _int8_agrees_on(
    linears: SmallRowLinears, dequantized: dict[torch.nn.Linear, torch.Tensor], module: torch.nn.Linear, x: torch.Tensor
) -> bool:
    """Whether the int8 kernel computes ``F.linear`` over the dequantized copy for ``x`` (on
    the output channels ``dequantized`` holds), within the bound the activations' rounding
    allows."""
    part = dequantized[module]
    copy = linears.weights[module]
    assert not isinstance(copy, torch.Tensor)
    return _within_copy_rounding(copy, part, None if module.bias is None else module.bias[: part.shape[0]], x)


def _within_copy_rounding(
    copy: Int8Linear | FourBitLinear | SiblingProduct, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> bool:
    """Whether a rounded copy's product for ``x``, on the output channels ``weight`` holds,
    is ``F.linear`` over ``weight`` to within the rounding the copy allows."""
    expected = F.linear(x, weight, bias)
    got = copy(x)[..., : weight.shape[0]]
    return got.shape == expected.shape and copy.within_rounding(got, expected, x, weight)


@torch.no_grad()
def _weights(name: SmallRowKernel, modules: Sequence[torch.nn.Linear]) -> dict[torch.nn.Linear, torch.Tensor]:
    if name == "packed":
        return {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACKED_FOR_ROWS) for m in modules}
    return {m: m.weight.detach() for m in modules}


def _onednn_agrees_on(weights: dict[torch.nn.Linear, torch.Tensor], module: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Whether oneDNN over ``weights`` computes ``F.linear``'s result for ``x``, to float32
    rounding."""
    expected = F.linear(x, module.weight, module.bias)
    got = _product(weights[module], module.bias)(x)
    scale = float(expected.abs().max()) + 1e-6
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)
