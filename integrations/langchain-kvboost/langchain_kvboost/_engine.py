"""Where the LangChain classes get their engine: one passed in, a model folder, or the default.

Engines built here are shared per process, keyed by model path and settings, so that several
``KVBoostLLM`` / ``ChatKVBoost`` objects over the same model read and fill one K/V cache and
the model is loaded once. ``kvboost_rag`` (and with it torch and transformers) is imported
only when an engine is actually needed.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvboost_rag import KVBoost

logger = logging.getLogger(__name__)

_ENGINES: dict[tuple[str | None, tuple[tuple[str, str], ...]], KVBoost] = {}
_ENGINES_LOCK = threading.Lock()


def _model_key(model: str | Path | None) -> str | None:
    if model is None:
        return None
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _settings_key(engine_kwargs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, repr(value)) for name, value in engine_kwargs.items()))


def resolve_engine(
    engine: Any | None,
    model: str | Path | None,
    engine_kwargs: dict[str, Any] | None,
) -> KVBoost:
    """Return the engine a LangChain object should use.

    Args:
        engine: A ready ``kvboost_rag.KVBoost``; used as is.
        model: Path of a local HuggingFace model folder; ``None`` selects the embedded
            default model.
        engine_kwargs: ``KVBoostSettings`` fields used when the engine is built here.

    Returns:
        The given engine, or a process-wide shared engine for ``(model, engine_kwargs)``.

    Raises:
        ValueError: ``engine`` was given together with ``model`` or ``engine_kwargs``, or is
            not a ``KVBoost``.
        kvboost_rag.ModelNotFoundError: ``model`` names no loadable model.
    """
    from kvboost_rag import KVBoost

    if engine is not None:
        if model is not None or engine_kwargs:
            raise ValueError(
                "Pass either `engine` or `model`/`engine_kwargs`, not both: settings of an "
                "existing engine are fixed when it is built (KVBoost.from_pretrained(..., **settings))."
            )
        if not isinstance(engine, KVBoost):
            raise ValueError(
                f"`engine` must be a kvboost_rag.KVBoost, got {type(engine).__name__}; build one "
                "with KVBoost.from_pretrained(path) or KVBoost.from_model(model, tokenizer)."
            )
        return engine

    kwargs = dict(engine_kwargs or {})
    key = (_model_key(model), _settings_key(kwargs))
    with _ENGINES_LOCK:
        shared = _ENGINES.get(key)
        if shared is not None:
            return shared
        label = str(model) if model is not None else "the embedded default model"
        logger.info("Loading %s for kvboost (settings: %s)", label, kwargs or "defaults")
        if model is None:
            built = KVBoost.from_pretrained(**kwargs)
        else:
            built = KVBoost.from_pretrained(str(model), **kwargs)
        _ENGINES[key] = built
        return built


def engine_of(target: Any) -> KVBoost:
    """The engine behind ``target``: a ``KVBoost`` itself, or an object with an ``engine``.

    Args:
        target: A ``kvboost_rag.KVBoost``, a ``KVBoostLLM`` or a ``ChatKVBoost``.

    Raises:
        TypeError: ``target`` neither is nor holds a ``KVBoost``.
    """
    from kvboost_rag import KVBoost

    if isinstance(target, KVBoost):
        return target
    inner = getattr(target, "engine", None)
    if isinstance(inner, KVBoost):
        return inner
    raise TypeError(
        f"Expected a kvboost_rag.KVBoost, KVBoostLLM or ChatKVBoost, got {type(target).__name__}."
    )
