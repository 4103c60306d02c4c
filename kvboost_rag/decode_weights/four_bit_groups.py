"""Decode on a model's stored 4-bit weights: layers whose float32 weights are 4-bit groups.

A model converted from a GGUF file (the embedded model, any ``convert_gguf`` output) holds the
file's weights dequantized to float32. Where the file stored a tensor as Q4_0, Q4_1 or Q4_K,
every run of 32 weights along a row is one of 16 evenly spaced values: ``low + step * q`` with
``q`` in 0..15 (Q4_K's rows take fewer than 16 of them in some runs). Those weights are read
back as they were stored, 4 bits each, with one step and one offset per run: the float32 weights
are searched for that form at load (:func:`four_bit_groups`, exact to a 1/1024 of a step for
every weight, or the layer is left alone), so it applies to whatever wrote them, without the
GGUF file or its tensor names.

The product is torch's ``_weight_int4pack_mm_for_cpu`` (the kernel of torch's own 4-bit
weight-only linears on CPU) with bfloat16 activations, steps and offsets (its float16 and
float32 paths are unvectorized, 30-65x slower on one row), its output widened to float32:
an eighth of the float32 bytes read per step. The weights' values are the model's own up to the bfloat16
rounding of each run's step and offset (2**-9 relative); the activations and sums are rounded to
bfloat16 too. Measured (docs/benchmarks.md): the embedded model's 210 projection layers, one-row
step over 2.4k keys 62.1 -> 43.7 ms on a 2-core Intel Xeon; next-token KL against the model's own
weights median 1.06e-4, answers equal up to the first near tie on 12 of 12 prompts. Read with
``decode_weights="stored"`` and wherever decode reads int8. The kernel computes each row on its own (bitwise the
same alone or among others), so a verify step's tokens get a one-token step's results.

The layers that read one input (query/key/value, gate/up) are multiplied as one when all of
them are 4-bit groups (:mod:`kvboost_rag.decode_weights.int8_siblings`' sharing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvboost_rag.decode_weights.int8_siblings import SharedInput, SiblingProduct, joined_bias, sibling_groups

logger = logging.getLogger(__name__)

#: Weights per run that share a step and an offset (GGUF's 4-bit block of 32).
GROUP = 32
#: Largest 4-bit value (``q`` in ``0..LEVELS``).
LEVELS = 15
#: Largest distance of a weight from its run's grid, in steps, for the run to be 4-bit.
GRID_TOLERANCE = 2.0**-10
#: Rows searched at once (bounds the search's float32 temporaries).
CHUNK_ROWS = 1024
#: The kernel's split of the input width into tiles (``_convert_weight_to_int4pack_for_cpu``).
INNER_K_TILES = 2
#: The kernel packs output channels by this many (a layer with other counts keeps its kernel).
ROW_MULTIPLE = 16


@dataclass
class FourBitGroups:
    """A weight as 4-bit values with one step and one offset per run of :data:`GROUP` weights.

    Attributes:
        values: ``[out, in]`` int32 in ``0..LEVELS``.
        steps: ``[out, in / GROUP]`` float32.
        lows: ``[out, in / GROUP]`` float32: the run's value for ``q = 0``.
    """

    values: torch.Tensor
    steps: torch.Tensor
    lows: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """``lows + steps * values`` as ``[out, in]`` float32 (for checks)."""
        rows, width = self.values.shape
        runs = self.values.view(rows, width // GROUP, GROUP).float() * self.steps[..., None] + self.lows[..., None]
        return runs.view(rows, width)


def four_bit_available() -> bool:
    """Whether this torch build has the CPU 4-bit kernel and its weight packing."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


@torch.no_grad()
def four_bit_groups(weight: torch.Tensor) -> FourBitGroups | None:
    """``weight`` (``[out, in]``) as 4-bit runs, or ``None`` when some run of :data:`GROUP`
    weights is not 16 evenly spaced values to within :data:`GRID_TOLERANCE` of a step (or
    ``in`` is not a multiple of :data:`GROUP`, or ``out`` of :data:`ROW_MULTIPLE`)."""
    rows, width = weight.shape
    if width % GROUP or rows % ROW_MULTIPLE or not rows:
        return None
    starts = [0, *range(1, rows, CHUNK_ROWS)]  # the first row alone: it refuses most weights
    parts = []
    for start, stop in zip(starts, [*starts[1:], rows]):
        part = _chunk_groups(weight.detach()[start:stop].float())
        if part is None:
            return None
        parts.append(part)
    return FourBitGroups(*(torch.cat(field) for field in zip(*parts)))


def _chunk_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`four_bit_groups` of some rows: each run's step is its span over the most levels
    (15, then fewer for runs that do not reach both ends of their grid) that fit every weight."""
    runs = weight.view(weight.shape[0], -1, GROUP)
    low = runs.amin(-1)
    span = runs.amax(-1) - low
    values = torch.zeros(runs.shape, dtype=torch.int32)
    steps = torch.zeros_like(span)
    todo = span > 0  # a constant run: step 0, values 0
    for levels in range(LEVELS, 0, -1):
        if not bool(todo.any()):
            break
        sub, sub_low, step = runs[todo], low[todo], span[todo] / levels
        q = torch.round((sub - sub_low[:, None]) / step[:, None])
        fits = (q * step[:, None] + sub_low[:, None] - sub).abs().amax(-1) <= GRID_TOLERANCE * step
        where = todo.nonzero(as_tuple=True)
        chosen = tuple(index[fits] for index in where)
        values[chosen], steps[chosen] = q[fits].to(torch.int32), step[fits]
        todo[chosen] = False
    if bool(todo.any()):
        return None
    return values.view(weight.shape), steps, low


class FourBitLinear:
    """One layer's (or fused group's) 4-bit copy read by ``_weight_int4pack_mm_for_cpu``.

    Args:
        groups: The weight's 4-bit runs (:func:`four_bit_groups`); not kept.
        bias: The layer's bias (kept by reference, added in float32), or ``None``.
    """

    def __init__(self, groups: FourBitGroups, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = groups.values.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.values, INNER_K_TILES)
        # The kernel's weight is (q - 8) * step + offset per run: offset = low + 8 * step.
        offsets = groups.lows + 8 * groups.steps
        self.steps_offsets = torch.stack([groups.steps.t(), offsets.t()], dim=-1).contiguous().to(torch.bfloat16)
        self.bias = bias
        #: Bytes of the copy: the packed values and two bfloat16 numbers per run.
        self.nbytes = self.packed.numel() * self.packed.element_size() + self.steps_offsets.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` of any leading shape (float32 out)."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.steps_offsets).float()
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def within_rounding(self, got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``got`` is ``x @ weight.T`` (``expected``) to within the bfloat16 rounding of
        the activations, the runs' steps and offsets and the output (8 significant bits each):
        per output, ``3 * 2**-8 * sum(|x| |w|)`` plus ``2**-8 |expected|``."""
        bound = 3 * 2.0**-8 * (x.abs() @ weight.abs().T) + 2.0**-8 * expected.abs() + 1e-6
        return bool(((got - expected).abs() <= bound).all())


def four_bit_linears(model: torch.nn.Module, eligible: Sequence[torch.nn.Linear]) -> dict[torch.nn.Linear, FourBitLinear | SiblingProduct]:
    """The 4-bit copies of ``eligible``'s layers whose weights are 4-bit runs, the layers that
    read one input fused where all of them are; ``{}`` where the kernel is missing."""
    if not four_bit_available():
        return {}
    found = {}
    for layer in eligible:
        groups = four_bit_groups(layer.weight)
        if groups is not None:
            found[layer] = groups
    copies: dict[torch.nn.Linear, FourBitLinear | SiblingProduct] = {}
    for group in sibling_groups(model, list(found)):
        fused = FourBitLinear(_joined([found[layer] for layer in group]), joined_bias([layer.bias for layer in group], [layer.out_features for layer in group]))
        shared = SharedInput(fused, [layer.out_features for layer in group])
        copies.update({layer: SiblingProduct(shared, index) for index, layer in enumerate(group)})
    for layer, groups in found.items():
        if layer not in copies:
            copies[layer] = FourBitLinear(groups, layer.bias)
    return {layer: copies[layer] for layer in found}  # the model's order


def _joined(parts: Sequence[FourBitGroups]) -> FourBitGroups:
    """Several layers' runs, their rows end to end."""
    return FourBitGroups(*(torch.cat(field) for field in zip(*((p.values, p.steps, p.lows) for p in parts))))
