"""Old public names that keep working, with a ``DeprecationWarning`` the first time each is used.

Both integrations renamed a few public names to share one vocabulary (``KVBoostPrewarmer``,
``KVBoostRetrievalWarmer``, ``engine_settings``). The old names stay as aliases: a module
sets ``__getattr__ = renamed_attributes(__name__, {old: new})`` (see
:func:`renamed_attributes`); a keyword argument calls :func:`warn_deprecated`.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

_warned: set[str] = set()
_lock = threading.Lock()


def warn_deprecated(old: str, new: str, stacklevel: int = 3, skip_packages: tuple[str, ...] = ()) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``, once per process and name.

    Args:
        old: The deprecated name, as the user wrote it.
        new: The name to use instead.
        stacklevel: Passed to ``warnings.warn``; the default points at the caller of the
            function that calls this one.
        skip_packages: When given, ``stacklevel`` is ignored and the warning points at the
            first frame outside these packages (e.g. user code calling a pydantic model whose
            validator warns, through framework ``__init__`` methods).
    """
    with _lock:
        if old in _warned:
            return
        _warned.add(old)
    if skip_packages:
        stacklevel = _first_frame_outside(skip_packages)
    warnings.warn(
        f"{old} is deprecated and will be removed in a future release; use {new} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _first_frame_outside(packages: tuple[str, ...]) -> int:
    """``warnings.warn`` stacklevel (seen from ``warn_deprecated``) of the first frame outside ``packages``."""
    frame = sys._getframe(2)  # the caller of warn_deprecated
    level = 2
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not any(module == p or module.startswith(p + ".") for p in packages):
            return level
        frame = frame.f_back
        level += 1
    return 2


def renamed_module_attribute(
    module_name: str,
    name: str,
    renamed: Mapping[str, str],
    namespace: Mapping[str, Any],
) -> Any:
    """The body of a module ``__getattr__`` that serves renamed names.

    Args:
        module_name: The module's ``__name__``.
        name: The attribute looked up.
        renamed: ``{old name: new name}`` of this module.
        namespace: The module's ``globals()``, where the new names live.

    Returns:
        The object now called ``renamed[name]``.

    Raises:
        AttributeError: ``name`` is not an old name of this module.
    """
    new = renamed.get(name)
    if new is None:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    # Frames: warnings.warn <- warn_deprecated <- here <- module __getattr__ <- the user's code.
    warn_deprecated(f"{module_name}.{name}", f"{module_name}.{new}", stacklevel=4)
    return namespace[new]


def renamed_attributes(module_name: str, renamed: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves the old names of renamed attributes.

    Args:
        module_name: The module's ``__name__``.
        renamed: ``{old name: new name}`` of this module.

    Returns:
        The function to assign to the module's ``__getattr__``.

    Example:
        .. code-block:: python

            __getattr__ = renamed_attributes(__name__, {"KVBoostPrewarm": "KVBoostPrewarmer"})
    """
    names = dict(renamed)

    def __getattr__(name: str) -> Any:
        return renamed_module_attribute(module_name, name, names, vars(sys.modules[module_name]))

    return __getattr__
