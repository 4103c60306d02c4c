"""Running a range of a model's decoder layers.

The repair runs some passes through part of the model: CacheBlend's selection stops after
``check_layer``, gradual filtering runs the layers in spans. :class:`DecoderLayers` finds the
decoder layer list once and, within :meth:`DecoderLayers.only`, lets the model run a range of
them (fed a hidden state from the layer before) or stop after one. These passes run whole, on
the engine loop's thread: no other pass runs while the layer list is changed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvboost_rag.errors import UnsupportedModelError


class StopForward(Exception):
    """Raised by a hook to end a forward pass after a chosen layer."""


class DecoderLayers:
    """The decoder layers of a model.

    Args:
        model: A transformers causal LM.
        count: Number of decoder layers (from the probed K/V layout).

    Raises:
        UnsupportedModelError: No ``ModuleList`` of ``count`` layers in the model.
    """

    def __init__(self, model: torch.nn.Module, count: int) -> None:
        modules = dict(model.named_modules())
        for name, module in modules.items():
            if isinstance(module, torch.nn.ModuleList) and len(module) == count:
                owner_name, _, attribute = name.rpartition(".")
                self._owner, self._attribute, self._layers = modules[owner_name], attribute, module
                return
        raise UnsupportedModelError("cannot find the decoder layers of this model")

    @contextmanager
    def stop_after(self, layer: int) -> Iterator[list[torch.Tensor]]:
        """Within the block a forward pass run by this thread raises :class:`StopForward` after
        decoder layer ``layer`` (passes of other threads run through); the yielded list
        receives that layer's ``[1, tokens, hidden]`` output."""
        captured: list[torch.Tensor] = []
        owner = threading.get_ident()

        def stop(_module, _args, output) -> None:
            if threading.get_ident() != owner:
                return
            captured.append(output[0] if isinstance(output, tuple) else output)
            raise StopForward

        handle = self._layers[layer].register_forward_hook(stop)
        try:
            yield captured
        finally:
            handle.remove()

    @contextmanager
    def only(self, first_layer: int, last_layer: int, hidden: torch.Tensor | None) -> Iterator[None]:
        """Within the block the model runs decoder layers ``first_layer..last_layer`` only,
        the first of them fed ``hidden`` (when given) instead of the embeddings' way up."""
        layers = self._layers

        def inject(_module, args, kwargs):
            if args:
                return (hidden.to(args[0].dtype), *args[1:]), kwargs
            kwargs["hidden_states"] = hidden.to(kwargs["hidden_states"].dtype)
            return args, kwargs

        # Models that look up each layer's type by its index in the loop (Gemma 3's RoPE per
        # layer type, Qwen's masks) see the types of the layers that actually run.
        config = getattr(self._owner, "config", None)
        layer_types = getattr(config, "layer_types", None)
        handle = layers[first_layer].register_forward_pre_hook(inject, with_kwargs=True) if hidden is not None else None
        setattr(self._owner, self._attribute, torch.nn.ModuleList(list(layers)[first_layer : last_layer + 1]))
        if layer_types:
            config.layer_types = list(layer_types)[first_layer : last_layer + 1]
        try:
            yield
        finally:
            setattr(self._owner, self._attribute, layers)
            if layer_types:
                config.layer_types = layer_types
            if handle is not None:
                handle.remove()
