"""Int8 weight copies for decode and verify steps: a quarter of the bytes a step reads.

On a CPU a decode step is bound by the bytes it reads: every weight once, whatever its few rows.
An int8 copy of each linear layer's weight with one float32 scale per output channel
(symmetric, round to nearest: ``w ~ q * scale``, ``q`` in [-127, 127]) is read by torch's
``torch.ops.aten._weight_int8pack_mm`` (the kernel public int8 weight-only linears call on a
CPU in eager mode). Its vectorized CPU path takes bfloat16 activations (with float32 or float16
activations it runs a scalar loop, 4-7x slower than float32 ``F.linear``; measured with torch
2.13 on AVX-512 and AVX2): each step's activations are rounded to bfloat16, the kernel sums in
float32 and returns bfloat16, and the per-channel scale is applied in float32 to that result
(the kernel is handed unit scales, so the scales keep their float32 precision). Nothing here
writes a matrix product.

The copy is made once at load; the model's own float32 weights stay (prefill and the repair,
which are compute-bound, read them, as does anything else that calls the model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Largest magnitude of a quantized weight (symmetric: -127..127, -128 unused).
QMAX = 127


def int8_available() -> bool:
    """Whether this torch build has the int8 weight-only kernel and a vectorized CPU path for it
    (AVX2 or AVX-512; the scalar fallback is slower than float32)."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return False
    return capability.upper().startswith(("AVX2", "AVX512"))


#: Rows quantized at a time (the float32 temporaries stay this small: a large output layer's
#: whole-weight temporaries stayed resident after load, 0.45 GB for Qwen 0.5B's).
CHUNK_ROWS = 1024


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


def int8_product(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ (q * scales).T + bias`` for float32 ``x`` of any leading shape (float32 out;
    ``x`` and the unscaled sums rounded to bfloat16, see the module's doc)."""
    out_features, in_features = q.shape
    unit = torch.ones(out_features, dtype=torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, q, unit).to(torch.float32).mul_(scales)
        if bias is not None:
            y = y.add_(bias)
        return y.view(*x.shape[:-1], out_features)

    return run


def copy_bytes(q: torch.Tensor, scales: torch.Tensor) -> int:
    """Bytes an int8 copy holds."""
    return q.numel() * q.element_size() + scales.numel() * scales.element_size()
