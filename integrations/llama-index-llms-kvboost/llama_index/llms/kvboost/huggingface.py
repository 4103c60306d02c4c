"""What ``HuggingFaceLLM`` users type, mapped onto ``KVBoostLLM``'s arguments.

``model_name``/``tokenizer_name`` name the model folder, ``generate_kwargs`` become generation
fields, ``device_map`` and ``model_kwargs`` become engine settings, ``query_wrapper_prompt``
becomes the completion formatter. Arguments the engine cannot honour raise
:class:`kvboost_rag.InvalidInputError` naming the alternative (the shared rules are in
:mod:`kvboost_rag.integration.dropin`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvboost_rag import InvalidInputError
from kvboost_rag.integration.dropin import (
    device_setting,
    generation_fields,
    model_settings,
)


@dataclass(frozen=True)
class EngineArguments:
    """Where the engine comes from, and how completion prompts are rendered.

    Attributes:
        model_path: The model folder (``model_path`` or ``model_name``), or ``None``.
        engine_settings: ``KVBoostSettings`` fields, or ``None``.
        completion_to_prompt: The completion formatter (``query_wrapper_prompt``'s), or ``None``.
    """

    model_path: str | None
    engine_settings: dict[str, Any] | None
    completion_to_prompt: Callable[[str], str] | None


def huggingface_llm_arguments(
    kwargs: dict[str, Any],
    model_path: str | None,
    engine_settings: dict[str, Any] | None,
    completion_to_prompt: Callable[[str], str] | None,
) -> EngineArguments:
    """Map (and remove from ``kwargs``) the arguments ``HuggingFaceLLM`` users type.

    Args:
        kwargs: The other keyword arguments of ``KVBoostLLM``; generation fields from
            ``generate_kwargs`` are added to it.
        model_path: ``KVBoostLLM``'s own ``model_path``.
        engine_settings: ``KVBoostLLM``'s own ``engine_settings``.
        completion_to_prompt: ``KVBoostLLM``'s own ``completion_to_prompt``.

    Returns:
        The model path, engine settings and completion formatter to use.

    Raises:
        kvboost_rag.InvalidInputError: An argument the engine cannot honour (the message
            names the alternative), or two arguments that disagree.
    """
    model_path = _model_path(kwargs, model_path)
    _check_tokenizer(kwargs, model_path)
    settings = dict(engine_settings or {})
    settings.update(model_settings(kwargs.pop("model_kwargs", None)))
    device = device_setting(None, kwargs.pop("device_map", None))
    if device is not None:
        settings["device"] = device
    for field, value in generation_fields(kwargs.pop("generate_kwargs", None), "generate_kwargs").items():
        if field in kwargs and kwargs[field] != value:
            raise InvalidInputError(f"generate_kwargs[{field!r}]={value!r} and {field}={kwargs[field]!r} disagree; pass one")
        kwargs[field] = value
    formatter = _query_wrapper(kwargs.pop("query_wrapper_prompt", None), completion_to_prompt)
    return EngineArguments(model_path, settings or None, formatter)


def _model_path(kwargs: dict[str, Any], model_path: str | None) -> str | None:
    name = kwargs.pop("model_name", None)
    if name is None:
        return model_path
    if model_path is not None and str(model_path) != str(name):
        raise InvalidInputError(f"model_name={name!r} and model_path={model_path!r} disagree; pass one")
    return str(name)


def _check_tokenizer(kwargs: dict[str, Any], model_path: str | None) -> None:
    tokenizer_name = kwargs.pop("tokenizer_name", None)
    if tokenizer_name is not None and str(tokenizer_name) != str(model_path):
        raise InvalidInputError(
            f"tokenizer_name={tokenizer_name!r} differs from the model {model_path!r}: kvboost reads prompts with "
            "the model's own tokenizer; load both yourself and pass model= and tokenizer="
        )
    if kwargs.pop("tokenizer_kwargs", None):
        raise InvalidInputError(
            "tokenizer_kwargs are not supported; load the tokenizer yourself "
            "(AutoTokenizer.from_pretrained(..., **kwargs)) and pass model= and tokenizer="
        )
    stopping_ids = kwargs.pop("stopping_ids", None)
    if stopping_ids:
        raise InvalidInputError(
            f"stopping_ids={stopping_ids!r} is not supported; pass stop=[...] strings (the model's own EOS "
            "tokens always end generation)"
        )


def _query_wrapper(wrapper: Any, completion_to_prompt: Callable[[str], str] | None) -> Callable[[str], str] | None:
    if wrapper is None:
        return completion_to_prompt
    if completion_to_prompt is not None:
        raise InvalidInputError("pass query_wrapper_prompt or completion_to_prompt, not both")
    template = str(getattr(wrapper, "template", wrapper))
    if "{query_str}" not in template:
        raise InvalidInputError(f"query_wrapper_prompt must contain {{query_str}}, got {template!r}")
    return partial(_wrap_query, template)


def _wrap_query(template: str, query: str) -> str:
    return template.replace("{query_str}", query)
