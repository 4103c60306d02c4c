"""Where framework objects get their engine: one passed in, a model folder, a loaded model, or the default.

Both integrations build their engine here. Engines built from a model folder (or the embedded
default model) are shared per process, keyed by the resolved folder and the settings, so that
several LLM objects over the same model read and fill one K/V cache and the model is loaded
once. An engine built around an already loaded model object is not shared: the caller owns
that model.

Error messages name the caller's own arguments (``ArgumentNames``), so that they name the fix
in the vocabulary of the framework class the user called. The module itself is light: the
engine (and with it torch and transformers) is imported only when one is needed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvboost_rag.engine import KVBoost

logger = logging.getLogger(__name__)

EngineKey = tuple[str | None, tuple[tuple[str, str], ...]]

_ENGINES: dict[EngineKey, KVBoost] = {}
_ENGINES_LOCK = threading.Lock()


@dataclass(frozen=True)
class ArgumentNames:
    """How the calling class names the engine sources, for error messages.

    Attributes:
        engine: The argument holding a ready ``KVBoost``.
        model_path: The argument holding a model folder path.
        model: The argument holding a loaded model object.
        tokenizer: The argument holding that model's tokenizer.
        settings: The argument holding ``KVBoostSettings`` fields.
    """

    engine: str = "engine"
    model_path: str = "model_path"
    model: str = "model"
    tokenizer: str = "tokenizer"
    settings: str = "engine_settings"


DEFAULT_NAMES = ArgumentNames()


def _model_key(model_path: str | Path | None) -> str | None:
    if model_path is None:
        return None
    path = Path(model_path).expanduser()
    return str(path.resolve()) if path.exists() else str(model_path)


def _settings_key(settings: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, repr(value)) for name, value in settings.items()))


def shared_engine(model_path: str | Path | None = None, settings: Mapping[str, Any] | None = None) -> KVBoost:
    """The process-wide engine for a model folder (or the default model) and settings.

    Args:
        model_path: Local HuggingFace model folder; ``None`` selects the embedded default
            model.
        settings: ``KVBoostSettings`` fields.

    Returns:
        The engine built by the first call with the same folder and settings.

    Raises:
        kvboost_rag.ModelNotFoundError: ``model_path`` names no loadable model.
    """
    from kvboost_rag.engine import KVBoost

    kwargs = dict(settings or {})
    key = (_model_key(model_path), _settings_key(kwargs))
    with _ENGINES_LOCK:
        shared = _ENGINES.get(key)
        if shared is not None:
            return shared
        label = str(model_path) if model_path is not None else "the embedded default model"
        logger.info("Loading %s for kvboost (settings: %s)", label, kwargs or "defaults")
        if model_path is None:
            built = KVBoost.from_pretrained(**kwargs)
        else:
            built = KVBoost.from_pretrained(str(model_path), **kwargs)
        _ENGINES[key] = built
        return built


def clear_shared_engines() -> None:
    """Forget the shared engines (they stay alive while something still holds them)."""
    with _ENGINES_LOCK:
        _ENGINES.clear()


def resolve_engine(
    engine: Any | None = None,
    *,
    model_path: str | Path | None = None,
    model: Any | None = None,
    tokenizer: Any | None = None,
    settings: Mapping[str, Any] | None = None,
    names: ArgumentNames = DEFAULT_NAMES,
) -> KVBoost:
    """The engine from exactly one source: an engine, a folder, a loaded model, or the default.

    Args:
        engine: A ready ``kvboost_rag.KVBoost``; used as is.
        model_path: Local HuggingFace model folder; its engine is shared (see
            :func:`shared_engine`).
        model: A loaded causal LM, with ``tokenizer``; a new engine is built around it.
        tokenizer: The fast tokenizer of ``model``.
        settings: ``KVBoostSettings`` fields for an engine built here.
        names: The caller's names for these arguments, used in error messages.

    Returns:
        The engine to use. With no source at all, the shared engine of the embedded default
        model.

    Raises:
        ValueError: Several sources, ``settings`` with a ready engine, ``model`` without
            ``tokenizer`` (or the reverse), or ``engine`` that is not a ``KVBoost``.
        kvboost_rag.ModelNotFoundError: ``model_path`` names no loadable model.
    """
    from kvboost_rag.engine import KVBoost

    given = [
        name
        for name, value in ((names.engine, engine), (names.model_path, model_path), (names.model, model))
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"Pass only one of {', '.join(f'{name}=' for name in given)}, "
            f"{'not both' if len(given) == 2 else 'not all of them'}: an engine comes from one source."
        )
    if (model is None) != (tokenizer is None):
        raise ValueError(f"{names.model}= and {names.tokenizer}= go together; pass the loaded model's tokenizer too.")
    if engine is not None:
        if settings:
            raise ValueError(
                f"Pass either {names.engine}= or {names.settings}=, not both: {names.settings} apply to an "
                "engine built here; settings of an existing engine are fixed when it is built "
                "(KVBoost.from_pretrained(..., **settings))."
            )
        if not isinstance(engine, KVBoost):
            raise ValueError(
                f"`{names.engine}` must be a kvboost_rag.KVBoost, got {type(engine).__name__}; build one "
                "with KVBoost.from_pretrained(path) or KVBoost.from_model(model, tokenizer)."
            )
        return engine
    if model is not None:
        return KVBoost.from_model(model, tokenizer, **dict(settings or {}))
    return shared_engine(model_path, settings)


def engine_of(target: Any) -> KVBoost:
    """The engine behind ``target``: a ``KVBoost`` itself, or an object whose ``engine`` is one.

    Args:
        target: A ``kvboost_rag.KVBoost``, or a framework LLM built on one (LangChain
            ``KVBoostLLM`` / ``ChatKVBoost``, LlamaIndex ``KVBoostLLM``).

    Raises:
        TypeError: ``target`` neither is nor holds a ``KVBoost``.
    """
    from kvboost_rag.engine import KVBoost

    if isinstance(target, KVBoost):
        return target
    inner = getattr(target, "engine", None)
    if isinstance(inner, KVBoost):
        return inner
    raise TypeError(
        "Expected a kvboost_rag.KVBoost or an LLM built on one (KVBoostLLM, ChatKVBoost), "
        f"got {type(target).__name__}."
    )
