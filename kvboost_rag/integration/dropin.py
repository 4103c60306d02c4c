"""What users of ``HuggingFacePipeline``, ``ChatHuggingFace`` and ``HuggingFaceLLM`` type, mapped
onto the engine.

Both integrations' drop-in constructors pass the transformers-style arguments they received
here: ``generate_kwargs`` / ``pipeline_kwargs`` become generation fields, ``device`` /
``device_map`` and ``model_kwargs`` become engine settings. Anything the engine cannot honour
raises :class:`~kvboost_rag.errors.InvalidInputError` naming what to use instead; nothing is
silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvboost_rag.errors import InvalidInputError

#: The generation fields both integrations take (``KVBoostLLM``/``ChatKVBoost`` fields).
GENERATION_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed")

#: Transformers ``generate`` arguments the engine does not implement, with what to use instead.
_UNSUPPORTED_GENERATION = {
    "top_k": "top_p (nucleus sampling) instead",
    "max_length": "max_new_tokens (tokens generated after the prompt)",
    "min_new_tokens": "stop strings or max_new_tokens",
    "min_length": "stop strings or max_new_tokens",
    "num_beams": "greedy decoding (temperature=0); beam search is not supported",
    "num_return_sequences": "one call per sequence, each with its own seed",
    "repetition_penalty": (
        "the repetition_penalty field of ChatKVBoost or GenerationOptions (it penalizes generated "
        "tokens only; transformers also penalizes the prompt's, which a RAG answer quotes)"
    ),
    "no_repeat_ngram_size": "a plain model call; n-gram blocking is not supported",
    "eos_token_id": "stop=[...] strings (the model's own EOS tokens always end generation)",
    "stopping_criteria": "stop=[...] strings",
    "return_full_text": "return_full_text=False (the answer never repeats the prompt)",
}


def generation_fields(kwargs: Mapping[str, Any] | None, source: str) -> dict[str, Any]:
    """Map transformers ``generate``/pipeline keyword arguments onto generation fields.

    ``do_sample=False`` decodes greedily (``temperature=0``); ``do_sample=True`` samples at the
    given ``temperature`` (1.0 when none is given, as transformers does). A ``temperature``
    without ``do_sample`` samples at that temperature.

    Args:
        kwargs: The arguments, e.g. ``{"temperature": 0.7, "do_sample": True, "max_new_tokens": 64}``.
        source: How the user passed them (``"generate_kwargs"``), for error messages.

    Returns:
        Fields among :data:`GENERATION_FIELDS`.

    Raises:
        InvalidInputError: An argument the engine does not implement (the message names the
            alternative), or ``do_sample=False`` with a positive ``temperature``.
    """
    if not kwargs:
        return {}
    kwargs = dict(kwargs)
    fields: dict[str, Any] = {}
    if kwargs.get("return_full_text") is False:
        kwargs.pop("return_full_text")
    for name, instead in _UNSUPPORTED_GENERATION.items():
        if name in kwargs:
            raise InvalidInputError(f"{source}[{name!r}] is not supported by kvboost; use {instead}")
    do_sample = kwargs.pop("do_sample", None)
    temperature = kwargs.pop("temperature", None)
    if do_sample is False and temperature not in (None, 0, 0.0):
        raise InvalidInputError(
            f"{source} has do_sample=False with temperature={temperature!r}: greedy decoding ignores the "
            "temperature; drop do_sample to sample at that temperature, or drop temperature to decode greedily"
        )
    if do_sample is False:
        fields["temperature"] = 0.0
    elif temperature is not None:
        fields["temperature"] = temperature
    elif do_sample:
        fields["temperature"] = 1.0
    for name in ("max_new_tokens", "top_p", "seed"):
        if name in kwargs:
            fields[name] = kwargs.pop(name)
    if kwargs:
        raise InvalidInputError(
            f"{source} has {sorted(kwargs)}, which kvboost does not implement; supported: "
            "max_new_tokens, temperature, top_p, do_sample, seed (and stop strings as stop=[...])"
        )
    return fields


def device_setting(device: int | str | None = None, device_map: Any = None) -> str | None:
    """The engine's ``device`` setting for a transformers ``device`` and/or ``device_map``.

    Args:
        device: A pipeline device: ``-1`` (CPU), a CUDA index, or a device string.
        device_map: ``"auto"`` (the engine's default: CUDA when available), or one device
            such as ``"cuda"``, ``"cuda:0"``, ``"cpu"``, ``"mps"``.

    Returns:
        The device string, or ``None`` for the engine's default.

    Raises:
        InvalidInputError: A ``device_map`` that splits the model over several devices (a
            dict, ``"balanced"``, ...), or a ``device`` and ``device_map`` that disagree.
    """
    from_device: str | None = None
    if isinstance(device, bool):
        raise InvalidInputError(f"device={device!r} is not a device; use -1 (CPU), a CUDA index or 'cuda'/'cpu'")
    if isinstance(device, int):
        from_device = "cpu" if device < 0 else f"cuda:{device}"
    elif device is not None:
        from_device = str(device)
    from_map: str | None = None
    if device_map is not None and device_map != "auto":
        if not isinstance(device_map, str) or device_map in ("balanced", "balanced_low_0", "sequential"):
            raise InvalidInputError(
                f"device_map={device_map!r} splits the model over devices, which kvboost does not support; "
                "use device_map='auto' or one device such as 'cuda' or 'cpu'"
            )
        from_map = device_map
    if from_device and from_map and from_device.split(":")[0] != from_map.split(":")[0]:
        raise InvalidInputError(f"device={device!r} and device_map={device_map!r} disagree; pass one of them")
    return from_device or from_map


def model_settings(model_kwargs: Mapping[str, Any] | None, source: str = "model_kwargs") -> dict[str, Any]:
    """Engine settings for the ``model_kwargs`` of ``from_pretrained``.

    Args:
        model_kwargs: ``{"torch_dtype": ...}`` or ``{"dtype": ...}`` (a ``torch.dtype`` or its
            name); ``"auto"`` keeps the engine's default.
        source: How the user passed them, for error messages.

    Returns:
        ``{"dtype": "bfloat16"}`` or ``{}``.

    Raises:
        InvalidInputError: Any other key (the message names the alternative).
    """
    if not model_kwargs:
        return {}
    kwargs = dict(model_kwargs)
    dtype = kwargs.pop("dtype", None)
    legacy = kwargs.pop("torch_dtype", None)
    if dtype is not None and legacy is not None and str(dtype) != str(legacy):
        raise InvalidInputError(f"{source} has dtype={dtype!r} and torch_dtype={legacy!r}; pass one")
    dtype = dtype if dtype is not None else legacy
    if kwargs:
        raise InvalidInputError(
            f"{source} has {sorted(kwargs)}, which kvboost does not pass to from_pretrained; load the model "
            "yourself (AutoModelForCausalLM.from_pretrained(..., **kwargs)) and pass model= and tokenizer="
        )
    if dtype is None or dtype == "auto":
        return {}
    return {"dtype": str(dtype).removeprefix("torch.")}
