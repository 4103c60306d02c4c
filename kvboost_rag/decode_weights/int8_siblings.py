"""Int8 layers that read the same input, multiplied as one: a step's query, key and value
projections in one call, its MLP's gate and up projections in another.

A decode step calls each layer's int8 product once per linear layer; most of a small layer's
call is its fixed cost (the row's scaling, the kernel's setup and its threads), not its bytes.
Measured on a 2-core Intel Xeon, 2 threads, one row over Qwen2.5 0.5B's shapes: the query, key
and value products 279 us as three calls, 96 us as one; gate and up 539 us against 377 us.

Each group's int8 values and scales are the layers' own (one scale per output channel, so the
concatenation quantizes nothing differently) and its bias the layers' biases end to end. The
model still calls every layer: the first call of a group on an input computes the whole
product, hands that layer its columns and holds the others' for their calls on the *same*
input tensor; a call on another input computes the product again. So a group is formed only
of the layers of :data:`SIBLING_NAMES`, which the model families that name them (Llama,
Qwen2, Mistral, Gemma and their kin) call one after another on one tensor they do not change
in between.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvboost_rag.decode_weights.int8_rows import Int8Linear, int8_linear, quantize_rows

#: Names of layers under one parent that read one input, in the order their outputs are laid.
SIBLING_NAMES: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_groups(model: torch.nn.Module, eligible: Sequence[torch.nn.Linear]) -> list[list[torch.nn.Linear]]:
    """The groups of :data:`SIBLING_NAMES` whose layers are all in ``eligible`` (distinct, with
    one input width), in the model's module order."""
    allowed = set(eligible)
    groups = []
    for parent in model.modules():
        for names in SIBLING_NAMES:
            members = [parent._modules.get(name) for name in names]
            if not all(member in allowed for member in members):
                continue
            if len({id(member) for member in members}) == len(members) and len({m.in_features for m in members}) == 1:
                groups.append(members)
    return groups


def fused_copy(quantized: Sequence[tuple[torch.Tensor, torch.Tensor]], biases: Sequence[torch.Tensor | None]) -> Int8Linear:
    """One int8 copy of several layers' :func:`~kvboost_rag.decode_weights.int8_rows.quantize_rows` results
    (their rows end to end) and biases (``None`` where none has one; zeros for a layer without)."""
    bias = joined_bias(biases, [q.shape[0] for q, _ in quantized])
    return int8_linear(torch.cat([q for q, _ in quantized]), torch.cat([s for _, s in quantized]), bias)


def joined_bias(biases: Sequence[torch.Tensor | None], widths: Sequence[int]) -> torch.Tensor | None:
    """Several layers' biases end to end (zeros of its width for a layer without one), ``None``
    where none has one."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(width) for b, width in zip(biases, widths)])


@torch.no_grad()
def fused_int8(
    group: Sequence[torch.nn.Linear], int8_values: Callable[[torch.nn.Linear], tuple[torch.Tensor, torch.Tensor]] | None = None
) -> list[SiblingProduct]:
    """One int8 copy for ``group``'s layers (:func:`fused_copy`) and each layer's product
    through it, in ``group``'s order.

    Args:
        group: The layers.
        int8_values: A layer's int8 values and scales (default: :func:`quantize_rows` of its
            float32 weight; a layer stored as int8 gives its own, :mod:`kvboost_rag.decode_weights.stored_int8`).
    """
    values = int8_values or (lambda layer: quantize_rows(layer.weight))
    fused = fused_copy([values(layer) for layer in group], [layer.bias for layer in group])
    shared = SharedInput(fused, [layer.out_features for layer in group])
    return [SiblingProduct(shared, index) for index in range(len(group))]


class FusedCopy(Protocol):
    """A fused product: an int8 copy (:data:`~kvboost_rag.decode_weights.int8_rows.Int8Linear`) or a
    4-bit one (:class:`~kvboost_rag.decode_weights.four_bit_groups.FourBitLinear`)."""

    in_features: int
    out_features: int
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def within_rounding(self, got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool: ...


class SharedInput:
    """A fused product whose output columns belong to several layers: each layer takes its
    own from the last product on its input (see the module's doc).

    Args:
        fused: The group's copy (int8 or 4-bit).
        widths: Each layer's output width, in the copy's order.
    """

    def __init__(self, fused: FusedCopy, widths: list[int]) -> None:
        self.fused = fused
        self.widths = widths
        self._held = threading.local()  # (input, outputs not taken yet) of this thread's last product

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s output for ``x``: from the last product when it was on ``x`` and
        the layer has not taken it yet, else from a new one."""
        held = getattr(self._held, "value", None)
        if held is None or held[0] is not x or held[1][index] is None:
            # A one-row step's columns are contiguous already (no copy); a verify step's are
            # copied, as model code may view them with dimensions merged.
            held = (x, [part.contiguous() for part in self.outputs(x)])
        taken, held[1][index] = held[1][index], None
        self._held.value = None if all(part is None for part in held[1]) else held
        return taken

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's output for ``x`` from one product, as views of its columns (callers
        that hand them to model code make them contiguous)."""
        return list(self.fused(x).split(self.widths, dim=-1))

    def forget(self) -> None:
        """Drop this thread's held outputs (and the input they hold)."""
        self._held.value = None


class SiblingProduct:
    """One layer's product through its group's fused copy (the interface of
    :data:`~kvboost_rag.decode_weights.int8_rows.Int8Linear`).

    Args:
        shared: The group's fused product.
        index: The layer's place in the group.
    """

    def __init__(self, shared: SharedInput, index: int) -> None:
        self.shared, self.index = shared, index
        self.in_features = shared.fused.in_features
        self.out_features = shared.widths[index]
        start = sum(shared.widths[:index])
        self._rows = slice(start, start + self.out_features)
        #: This layer's share of the fused copy's bytes.
        self.nbytes = shared.fused.nbytes // shared.fused.out_features * self.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` for this layer (float32)."""
        return self.shared.output(self.index, x)

    def dequantized(self) -> torch.Tensor:
        """The layer's rows of the weight the fused product multiplies by (for checks)."""
        return self.shared.fused.dequantized()[self._rows]

    def within_rounding(self, got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """The fused kernel's bound (per output channel, so it holds for a layer's columns)."""
        return self.shared.fused.within_rounding(got, expected, x, weight)
