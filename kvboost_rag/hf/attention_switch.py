"""The engine's attention functions, registered with transformers, and the switch to them.

Two attention functions run inside a model call: the per-segment attention of the engine
loop's packed passes (:mod:`kvboost_rag.hf.packed`) and the sparse causal attention of a pass
over one prompt run alone (:mod:`kvboost_rag.attention_backends.sparse`: passes through part of the
model, models that cannot pack). Each is registered under its name with transformers'
``AttentionInterface``, together with a mask function that builds no mask (both functions
derive causality from positions themselves), so transformers never spends time on a mask
they would ignore. :class:`AttentionSwitch` selects one of them for the duration of a block,
on every config the model's attention layers read (a multimodal model's text config
included), and restores the model's own implementation afterwards; :func:`model_with_attention`
makes a view of the model that always uses one of them, leaving the model as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ContextManager

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig

from kvboost_rag.hf.packed import PACKED_ATTENTION, packed_attention
from kvboost_rag.module_views import shared_copy
from kvboost_rag.attention_backends.sparse import ATTENTION_NAME, sparse_causal_attention


def _no_mask(*_args: Any, **_kwargs: Any) -> None:
    """Mask function of the engine's attention functions: they need none."""
    return None


for _name, _function in (
    (ATTENTION_NAME, sparse_causal_attention),
    (PACKED_ATTENTION, packed_attention),
):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, _no_mask)


class AttentionSwitch:
    """Switches a model's attention implementation for the duration of a block.

    Args:
        model: A transformers model; its configs are collected once here.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        configs: dict[int, PretrainedConfig] = {}
        for module in [model, *model.modules()]:
            config = getattr(module, "config", None)
            if isinstance(config, PretrainedConfig):
                configs.setdefault(id(config), config)
                text = config.get_text_config(decoder=True)
                configs.setdefault(id(text), text)
        self._configs = list(configs.values())
        self._own = [config._attn_implementation for config in self._configs]

    def use(self, name: str) -> ContextManager[None]:
        """Within the block every attention layer calls the function registered as ``name``.

        Args:
            name: :data:`~kvboost_rag.attention_backends.sparse.ATTENTION_NAME` or
                :data:`~kvboost_rag.hf.packed.PACKED_ATTENTION`.
        """
        return self._set([name] * len(self._configs))

    def own(self) -> ContextManager[None]:
        """Within the block the attention layers call the model's own implementation."""
        return self._set(self._own)

    @contextmanager
    def _set(self, names: list[str]) -> Iterator[None]:
        previous = [config._attn_implementation for config in self._configs]
        for config, name in zip(self._configs, names):
            config._attn_implementation = name
        try:
            yield
        finally:
            for config, implementation in zip(self._configs, previous):
                config._attn_implementation = implementation


def model_with_attention(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A view of ``model`` whose attention layers always call the function registered as
    ``name``: a copy of its module tree sharing every parameter and buffer, over copies of its
    configs with that implementation set. The model itself is not touched, so the view can be
    traced and run on one thread while the model runs with its own attention on another (what
    a switch on the shared configs cannot allow).

    Raises:
        ValueError: A module overrides ``forward`` on the instance (accelerate's dispatch
            hooks): the copy would call the original module's code.
    """
    configs: dict[int, PretrainedConfig] = {}

    def config_copy(config: PretrainedConfig) -> PretrainedConfig:
        copied = configs.get(id(config))
        if copied is None:
            copied = configs[id(config)] = copy.copy(config)
            for field, value in vars(config).items():  # nested configs (a text config) copied too
                if isinstance(value, PretrainedConfig):
                    setattr(copied, field, config_copy(value))
            copied._attn_implementation = name
        return copied

    def own_config(module: torch.nn.Module, copied: torch.nn.Module) -> None:
        config = vars(module).get("config")
        if isinstance(config, PretrainedConfig):
            copied.config = config_copy(config)

    return shared_copy(model, own_config)
