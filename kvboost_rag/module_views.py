"""Views of a model: a copy of its module tree that shares every parameter and buffer.

The engine runs some passes through such a view instead of the user's model, so that what it
changes for those passes (the attention implementation of captured steps, the decode kernels of
the linear layers) is never set on the user's own modules: the model the user holds runs as
it was, on any thread, while the engine's passes run the view.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

#: A module's forward hook tables: a view gets its own copies of them as they are when it is
#: made, so a hook put on the model for one pass (stopping after a layer, feeding a hidden
#: state) does not fire in the view's passes.
FORWARD_HOOKS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
)


def shared_copy(
    model: torch.nn.Module,
    adjust: Callable[[torch.nn.Module, torch.nn.Module], None] | None = None,
    own_hooks: bool = True,
) -> torch.nn.Module:
    """A copy of ``model``'s module tree sharing every parameter and buffer; ``adjust(module,
    copied)`` runs on each module's copy once its children are copied.

    Args:
        model: The model.
        adjust: Called with each module and its copy.
        own_hooks: The copies get copies of the modules' forward hook tables as they are now
            (:data:`FORWARD_HOOKS`); ``False``: they share the modules' tables, so a hook put
            on the model later runs in the view's passes too.

    Raises:
        ValueError: A module overrides ``forward`` on the instance (accelerate's dispatch
            hooks): the copy would call the original module's code.
    """

    def module_copy(module: torch.nn.Module) -> torch.nn.Module:
        if "forward" in vars(module):
            raise ValueError(f"{type(module).__name__} overrides forward on the instance (a dispatch hook)")
        copied = copy.copy(module)
        copied._modules = {key: None if child is None else module_copy(child) for key, child in module._modules.items()}
        copied._parameters = dict(module._parameters)
        copied._buffers = dict(module._buffers)
        for hooks in FORWARD_HOOKS if own_hooks else ():
            if hooks in vars(module):
                setattr(copied, hooks, type(vars(module)[hooks])(vars(module)[hooks]))
        if adjust is not None:
            adjust(module, copied)
        return copied

    return module_copy(model)
