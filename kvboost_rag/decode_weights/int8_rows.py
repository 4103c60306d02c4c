"""Int8 copies of the linear layers for decode and verify steps: a quarter of the bytes a step reads.

On a CPU a decode step is bound by the bytes it reads: every weight once, whatever its few rows.
Each linear layer's weight is copied as int8 values with one float32 scale per output channel
(symmetric, round to nearest: ``w ~ q * scale``, ``q`` in [-127, 127]) and read by one of two
kernels of torch, the first available:

- :class:`DynamicInt8Linear`: FBGEMM's dynamic quantized linear
  (``torch.ops.quantized.linear_dynamic`` over ``linear_prepack``'s packed layout, the kernel of
  ``torch.ao.nn.quantized.dynamic.Linear``): it rounds the activations to 8 bits, sums the
  products in int32 and scales the sums back to float32; used where it sums 8-bit activations
  exactly (CPUs with VNNI; without it, pairs of products are summed in 16 bits and can
  saturate, which a check at load finds);
- :class:`WeightOnlyInt8Linear`: ``torch.ops.aten._weight_int8pack_mm`` (int8 weights, bfloat16
  activations; its float32 path is a scalar loop), where the first is not used: a torch build
  without FBGEMM, or a CPU whose 8-bit sums saturate (an AVX2 CPU without VNNI, such as a 2-core
  AMD EPYC of family 25, where one row of a 4864 x 896 layer took 0.46 ms on one thread against
  1.45 ms for ``F.linear``).

Measured on a 2-core Intel Xeon (AVX-512), one thread, one row of a 4864 x 896 layer:
``F.linear`` 1.3-1.6 ms, the weight-only kernel 0.95 ms, the dynamic one 0.5-0.7 ms; a whole
decode step of Qwen2.5 0.5B over a 2.4k-token cache 85 ms against 159 ms and 187 ms
(``bench/int8_kernels.py``, docs/benchmarks.md). Torch 2.13 deprecates the quantized tensor
types that ``linear_prepack`` takes (their warning is kept out of the engine's load); where a
torch build no longer has them, decode falls back to the weight-only kernel.

The dynamic kernel takes one range for all the rows of a call (the smallest and largest
activation), which would make a row's result depend on the other rows of its step. So each row
is divided by its own largest magnitude, and the weight gets :data:`EDGE_COLUMNS` more input
columns of zeros whose activations are ``+1`` and ``-1``: every row then spans exactly
``[-1, 1]``, the range is the same for every call, each activation is rounded to a step of
``2 / 255`` of its row's largest magnitude, and the row's result is scaled back by its
magnitude. (FBGEMM's own 7-bit range, which CPUs without VNNI need, doubled the per-step KL
of Qwen2.5 0.5B's answers and failed the quality bar on one prompt in 19.) With either kernel a row alone or among others, in a decode step or a verify
step, gives the same float32 result: greedy tokens do not depend on drafts or on the other
sequences of a step.

The copy is made once at load; the model's own float32 weights stay (prefill and the repair,
which are compute-bound, read them, as does anything else that calls the model).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

logger = logging.getLogger(__name__)

#: Largest magnitude of a quantized weight (symmetric: -127..127, -128 unused).
QMAX = 127
#: Activation steps per row: 8 bits (0..255) over ``[-1, 1]``.
ACTIVATION_LEVELS = 255
#: Zero columns added to each weight, whose activations pin every row's range to ``[-1, 1]``
#: (two are needed; four keep the inner dimension a multiple of 4).
EDGE_COLUMNS = 4
#: Rows quantized at a time (the float32 temporaries stay this small: a large output layer's
#: whole-weight temporaries stayed resident after load, 0.45 GB for Qwen 0.5B's).
CHUNK_ROWS = 1024


def _vector_cpu() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX2", "AVX512"))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def dynamic_int8_available() -> bool:
    """Whether this torch build runs FBGEMM's dynamic quantized linear on this CPU (x86 with
    AVX2 or AVX-512) with 8-bit activations summed exactly (:func:`_sums_exactly`)."""
    try:
        engines = torch.backends.quantized.supported_engines
    except (AttributeError, RuntimeError):
        return False
    ops = torch.ops.quantized
    if "fbgemm" not in engines or not hasattr(ops, "linear_dynamic") or not hasattr(ops, "linear_prepack") or not _vector_cpu():
        return False
    try:
        return _sums_exactly()
    except RuntimeError as exc:
        logger.info("int8: FBGEMM's dynamic linear failed (%s); the weight-only kernel is used", exc)
        return False


@torch.inference_mode()
def _sums_exactly() -> bool:
    """Whether FBGEMM sums 8-bit activations without saturating: the worst case, every
    activation at the top of its range times every weight at 127, where CPUs without VNNI
    (pairs of products summed in 16 bits) would clip the sums to half."""
    width = 512
    copy = DynamicInt8Linear(torch.full((8, width), QMAX, dtype=torch.int8), torch.ones(8), None)
    for sign, rows in ((1.0, 1), (-1.0, 1), (1.0, 16)):  # one row and a verify step's
        got = copy(torch.full((rows, width), sign))
        if not bool(((got - sign * QMAX * width).abs() <= QMAX * width / ACTIVATION_LEVELS * 1.01).all()):
            logger.info("int8: FBGEMM's sums of 8-bit activations saturate on this CPU; the weight-only kernel is used")
            return False
    return True


def int8_available() -> bool:
    """Whether an int8 kernel with a vectorized CPU path applies here (AVX2 or AVX-512: the
    weight-only kernel's scalar fallback is slower than float32)."""
    return dynamic_int8_available() or (hasattr(torch.ops.aten, "_weight_int8pack_mm") and _vector_cpu())


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (``[out, in]``, float) as int8 values and one float32 scale per output row.

    Returns:
        ``(q, scales)``: ``q`` int8 ``[out, in]`` contiguous, ``scales`` float32 ``[out]``;
        ``q[i] * scales[i]`` is row ``i`` to within half a scale step.
    """
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, CHUNK_ROWS):
        w = weight.detach()[start : start + CHUNK_ROWS].to(torch.float32)
        peak = w.abs().amax(dim=1)
        scale = torch.where(peak > 0, peak / QMAX, torch.ones_like(peak))
        q[start : start + CHUNK_ROWS] = (w / scale[:, None]).round_().clamp_(-QMAX, QMAX)
        scales[start : start + CHUNK_ROWS] = scale
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q * scales`` per output row as float32: the weight :func:`quantize_rows`'s result stands for."""
    return q.float() * scales[:, None]


class DynamicInt8Linear:
    """One layer's int8 copy in FBGEMM's packed layout; its product rounds each row's
    activations to a step of ``2 / 255`` of the row's largest magnitude (see the module's doc).

    Args:
        q: ``[out, in]`` int8 values (:func:`quantize_rows`); not kept.
        scales: ``[out]`` float32 scale per output channel.
        bias: The layer's bias (kept by reference, added in float32), or ``None``.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = q.shape
        widened = torch.cat([q, q.new_zeros(self.out_features, EDGE_COLUMNS)], dim=1)
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates the quantized tensor types
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(widened, scales.double(), zero_points, 0)
            self.packed = torch.ops.quantized.linear_prepack(weight, None)
        self.bias = bias
        self._edge = torch.tensor([1.0, -1.0] + [0.0] * (EDGE_COLUMNS - 2))
        #: Bytes of the copy: int8 values, a float64 scale and an int32 column offset per channel.
        self.nbytes = self.out_features * (self.in_features + EDGE_COLUMNS) + self.out_features * 12

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` of any leading shape (float32 out)."""
        flat = x.reshape(-1, self.in_features)
        peak = torch.linalg.vector_norm(flat, float("inf"), dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        rows = torch.cat([flat / peak, self._edge.expand(flat.shape[0], EDGE_COLUMNS)], dim=1)
        y = torch.ops.quantized.linear_dynamic(rows, self.packed, False).mul_(peak)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the product multiplies by, ``[out, in]`` float32 (for checks)."""
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return weight.dequantize()[:, : self.in_features].float()

    def within_rounding(self, got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``got`` is ``x @ weight.T`` (``expected``) to within the activations'
        rounding: per output, half a step, ``max |x_row| / 255``, times ``sum |w|`` (with 1% for
        the float32 arithmetic), plus ``1e-5 |expected|``."""
        half_step = x.abs().amax(dim=-1, keepdim=True) / ACTIVATION_LEVELS
        bound = 1.01 * half_step * weight.abs().sum(dim=1) + 1e-5 * expected.abs() + 1e-6
        return bool(((got - expected).abs() <= bound).all())


class WeightOnlyInt8Linear:
    """One layer's int8 copy read by ``torch.ops.aten._weight_int8pack_mm``: each step's
    activations and the kernel's sums are rounded to bfloat16, the per-channel scales applied
    in float32 after (the kernel is handed unit scales, so the scales keep their precision).

    Args:
        q: ``[out, in]`` int8 values (:func:`quantize_rows`); kept.
        scales: ``[out]`` float32 scale per output channel.
        bias: The layer's bias (kept by reference), or ``None``.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = q.shape
        self.q, self.scales, self.bias = q, scales, bias
        self._unit = torch.ones(self.out_features, dtype=torch.bfloat16)
        #: Bytes of the copy: int8 values and a float32 scale per channel.
        self.nbytes = q.numel() + scales.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` of any leading shape (float32 out)."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self._unit).to(torch.float32).mul_(self.scales)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the product multiplies by, ``[out, in]`` float32 (for checks)."""
        return dequantize_rows(self.q, self.scales)

    def within_rounding(self, got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``got`` is ``x @ weight.T`` (``expected``) to within what rounding the
        activations and the output to bfloat16 (8 significant bits each) allows: per output,
        ``2 * 2**-8 * sum(|x| |w|)`` plus ``2**-8 |expected|``."""
        bound = 2 * 2.0**-8 * (x.abs() @ weight.abs().T) + 2.0**-8 * expected.abs() + 1e-6
        return bool(((got - expected).abs() <= bound).all())


Int8Linear = DynamicInt8Linear | WeightOnlyInt8Linear


def int8_linear(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """A layer's int8 copy on the first kernel available (see the module's doc).

    Raises:
        RuntimeError: Neither kernel is available (:func:`int8_available`).
    """
    if dynamic_int8_available():
        return DynamicInt8Linear(q, scales, bias)
    if int8_available():
        return WeightOnlyInt8Linear(q, scales, bias)
    raise RuntimeError("no int8 kernel with a vectorized CPU path in this torch build")
