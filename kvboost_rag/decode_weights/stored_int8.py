"""Linear layers a model already holds as int8: their stored values and scales, for decode.

A model quantized through transformers' torchao configuration (``TorchAoConfig`` with
``Int8WeightOnlyConfig`` or ``Int8DynamicActivationInt8WeightConfig``, or torchao's
``quantize_`` called on it) holds each linear layer's weight as torchao's ``Int8Tensor``: int8
values ``[out, in]`` and one scale per output channel, which is the form the engine's int8
copies take (:func:`~kvboost_rag.decode_weights.int8_rows.quantize_rows`). Such a layer has no float32
weight to copy; its own ``forward`` multiplies the activations by the int8 values widened to
float32 on every call, or rounds the activations to int8 first. Measured without drafts on
~2.4k-token chat prompts, 2 threads of a 2-core Intel Xeon (``bench/stored_int8_bench.py``):
Qwen2.5-Coder-0.5B quantized by ``Int8WeightOnlyConfig`` took 427-688 ms a token through its
own layers, 77-86 ms with decode reading the stored values (its float32 original's engine
70-83 ms), its tokens the same on 3 of 3 prompts.

:func:`stored_int8_linears` finds the layers whose stored values the engine's int8 kernel reads
as they are: a plain ``nn.Linear`` (as the small-row kernels take them) on the CPU whose weight is an ``Int8Tensor`` of 2-D int8
values with one scale per output channel, symmetric (zero points absent or zero), without an
activation pre-scale, in a float32 model (the int8 kernels take float32 activations). Where decode reads int8 (``decode_weights="int8"``, or ``"auto"`` for the models
measured, :data:`~kvboost_rag.decode_weights.small_rows.INT8_BY_DEFAULT`), decode and verify steps read
them through that kernel; prefill, the repair and any other caller run the layer's own
``forward``. Any other weight type (torchao's 4-bit or float8 tensors, per-group int8) keeps the
layer's own ``forward`` everywhere. torchao is not imported here: the weight is recognized by
its type's name and the tensors it flattens to.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: Type name of torchao's int8 weight tensor (``torchao.quantization.Int8Tensor``).
INT8_TENSOR_TYPE = "Int8Tensor"


def stored_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int8 values and per-channel float32 scales ``weight`` stands for, if it is a torchao
    ``Int8Tensor`` in the form the int8 kernels read (see the module's doc); else ``None``.

    Returns:
        ``(q, scales)``: ``q`` int8 ``[out, in]`` (the stored tensor itself), ``scales`` float32
        ``[out]`` (a view, or a float32 copy where they are stored in another dtype);
        ``q[i] * scales[i]`` is row ``i`` of the weight.
    """
    if type(weight).__name__ != INT8_TENSOR_TYPE or not is_traceable_wrapper_subclass(weight):
        return None
    if weight.dtype != torch.float32:  # the layer computes in another dtype: the kernels take float32
        return None
    q, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return None
    if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu" or not q.is_contiguous():
        return None
    if scale.numel() != q.shape[0] or not scale.is_floating_point():
        return None
    zero_point = getattr(weight, "zero_point", None)
    if getattr(weight, "act_pre_scale", None) is not None or (zero_point is not None and bool(zero_point.any())):
        return None
    if list(getattr(weight, "block_size", [])) != [1, q.shape[1]]:  # one scale per output channel
        return None
    return q, scale.reshape(-1).to(torch.float32)


def stored_int8_linears(modules: Iterable[torch.nn.Linear]) -> dict[torch.nn.Linear, tuple[torch.Tensor, torch.Tensor]]:
    """Those of ``modules`` (plain linear layers, :func:`~kvboost_rag.decode_weights.small_rows.plain_linears`)
    whose weights are stored int8 (:func:`stored_int8`), with their values and scales, in order."""
    found = {}
    for module in modules:
        stored = stored_int8(module.weight)
        bias = module.bias
        if stored is not None and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")):
            found[module] = stored
    return found
