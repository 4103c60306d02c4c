"""Exceptions raised by kvboost-rag.

Every error the engine raises on bad input derives from :class:`KVBoostError` and from the
builtin exception a caller would expect (``ValueError`` for bad values), so
``except ValueError`` keeps working.
"""

from __future__ import annotations


class KVBoostError(Exception):
    """Base class of every error raised by kvboost-rag."""


class InvalidInputError(KVBoostError, ValueError):
    """An argument has a value the engine cannot work with (empty prompt, bad ratio, ...)."""


class PromptTooLongError(InvalidInputError):
    """The prompt plus the requested new tokens do not fit the model's context window."""


class UnsupportedModelError(KVBoostError, ValueError):
    """The model or tokenizer cannot be used as asked (no tokenizer, no fast tokenizer, ...)."""


class ModelNotFoundError(KVBoostError, FileNotFoundError):
    """A model path does not exist or holds no loadable model."""


class RequestCancelled(KVBoostError):
    """The call was cancelled before its answer was complete (its stream closed, its awaiting
    task cancelled, its client gone)."""
