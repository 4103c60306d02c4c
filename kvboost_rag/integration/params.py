"""Per-call generation parameters: one set of names and aliases for both integrations.

A call of either framework class (``invoke``/``generate``/``stream`` in LangChain,
``complete``/``chat``/``stream_*`` in LlamaIndex) takes the keywords of
:data:`CALL_PARAMETERS`; :func:`call_params` checks them, resolves aliases
(``max_tokens`` for ``max_new_tokens``), fills what is not given from the LLM object's own
fields and returns the keyword arguments of ``KVBoost.generate`` / ``KVBoost.stream``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from kvboost_rag.errors import InvalidInputError

logger = logging.getLogger(__name__)

#: Every per-call parameter name, and the engine keyword it sets (aliases map to the same one).
CALL_PARAMETERS: Mapping[str, str] = MappingProxyType(
    {
        "max_new_tokens": "max_new_tokens",
        "max_tokens": "max_new_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "repetition_penalty": "repetition_penalty",
        "seed": "seed",
        "stop": "stop",
        "reuse": "reuse",
        "documents": "documents",
    }
)

#: Engine keywords whose default is a field of the LLM object (see :class:`GenerationDefaults`).
DEFAULTED = ("max_new_tokens", "temperature", "top_p", "repetition_penalty", "seed", "stop", "reuse")


class GenerationDefaults(Protocol):
    """The fields of an LLM object that give per-call parameters their defaults."""

    max_new_tokens: int
    temperature: float
    top_p: float
    repetition_penalty: float
    seed: int | None
    stop: Sequence[str] | None
    reuse: bool


class UnknownParameterError(InvalidInputError, TypeError):
    """A call got a keyword argument that is no per-call parameter.

    Both a ``ValueError`` (as every bad input of kvboost-rag) and a ``TypeError`` (as Python
    reports an unexpected keyword argument).
    """


@dataclass(frozen=True)
class DocumentConverter:
    """How a framework's document objects become the text a prompt holds.

    Attributes:
        convert: The text of one document object, or ``None`` for an object it does not
            know (strings never reach it).
        accepts: What the items may be, for error messages (``"str or Document"``).
    """

    convert: Callable[[Any], str | None]
    accepts: str


#: Strings only (no framework document objects).
STRINGS_ONLY = DocumentConverter(lambda item: None, "str")


def resolve_aliases(values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` where each alias of :data:`CALL_PARAMETERS` is renamed to its name.

    An alias set to ``None`` counts as not given.

    Args:
        values: Keyword arguments (a call's, or a constructor's).

    Returns:
        The arguments under their own names.

    Raises:
        InvalidInputError: An alias and its name are both set, to different values.
    """
    resolved = dict(values)
    for alias, name in CALL_PARAMETERS.items():
        if alias == name or alias not in resolved:
            continue
        value = resolved.pop(alias)
        if value is None:
            continue
        current = resolved.get(name)
        if current is not None and current != value:
            raise InvalidInputError(
                f"{alias}={value!r} and {name}={current!r} conflict: they are two names for the same "
                "parameter; set only one."
            )
        resolved[name] = value
    return resolved


def call_params(
    defaults: GenerationDefaults,
    overrides: Mapping[str, Any],
    *,
    owner: str,
    stop: Sequence[str] | str | None = None,
    fallback_documents: Any = None,
    documents: DocumentConverter = STRINGS_ONLY,
    ignored: Collection[str] = (),
) -> dict[str, Any]:
    """The keyword arguments of ``KVBoost.generate`` / ``KVBoost.stream`` for one call.

    Args:
        defaults: The LLM object; its fields fill what the call does not set.
        overrides: The call's keyword arguments (see :data:`CALL_PARAMETERS`).
        owner: The class name, for error messages.
        stop: Stop strings given apart from ``overrides`` (LangChain's ``stop`` argument);
            ``overrides["stop"]`` wins over it, and either replaces ``defaults.stop``. One
            string counts as a list of one.
        fallback_documents: Documents to use when the call names none (LangChain's run
            metadata ``{"documents": [...]}``).
        documents: How document objects other than strings become text.
        ignored: Keywords the framework itself passes down and that mean nothing here.

    Returns:
        ``max_new_tokens``, ``temperature``, ``top_p``, ``repetition_penalty``, ``seed``,
        ``stop`` (a list, or ``None``), ``reuse`` and ``documents`` (texts, or ``None``).

    Raises:
        UnknownParameterError: A keyword that is no per-call parameter.
        InvalidInputError: An alias and its name set to different values.
        TypeError: ``documents`` is not a list of strings or known document objects.
    """
    unknown = sorted(set(overrides) - set(CALL_PARAMETERS) - set(ignored))
    if unknown:
        raise UnknownParameterError(
            f"{owner} got unknown parameter(s) {unknown}; per-call parameters are {sorted(CALL_PARAMETERS)}"
        )
    given = {name: value for name, value in resolve_aliases(overrides).items() if name not in ignored}
    params = {name: given[name] if given.get(name) is not None else getattr(defaults, name) for name in DEFAULTED}
    if given.get("stop") is None and stop is not None:
        params["stop"] = stop
    params["stop"] = stop_strings(params["stop"])
    chosen = given.get("documents")
    params["documents"] = document_texts(fallback_documents if chosen is None else chosen, documents)
    return params


def stop_strings(stop: Sequence[str] | str | None) -> list[str] | None:
    """``stop`` as a list of strings (one string is a list of one), or ``None`` when empty.

    Raises:
        TypeError: An item is not a string.
    """
    if not stop:
        return None
    items = [stop] if isinstance(stop, str) else list(stop)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"`stop` must be a list of strings, got an item of type {type(item).__name__}.")
    return items


def document_texts(documents: Any, converter: DocumentConverter = STRINGS_ONLY) -> list[str] | None:
    """The texts of explicit documents.

    Args:
        documents: ``None``, or a list of strings and document objects ``converter`` knows.
        converter: How document objects become the text a prompt holds.

    Returns:
        The texts, in order, or ``None`` for no documents.

    Raises:
        TypeError: ``documents`` is not a list, or holds an item of another kind.
    """
    if documents is None:
        return None
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise TypeError(
            f"`documents` must be a list of strings or documents ({converter.accepts}), got "
            f"{type(documents).__name__}."
        )
    texts: list[str] = []
    for item in documents:
        text = item if isinstance(item, str) else converter.convert(item)
        if not isinstance(text, str):
            raise TypeError(f"`documents` items must be {converter.accepts}, got {type(item).__name__}.")
        texts.append(text)
    return texts or None
