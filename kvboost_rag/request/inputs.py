"""Input checks shared by every entry point: text the tokenizer can read, devices that exist."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost_rag.errors import InvalidInputError


def check_text(text: object, what: str) -> None:
    """Reject text the tokenizer cannot read, with an error that names the fix.

    Raises:
        InvalidInputError: Not a string, blank, or holding a lone surrogate.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(f"{what} must be a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{what} holds a lone surrogate at character {exc.start} ({text[exc.start]!r}), which is not "
            "valid Unicode text: decode your source with errors='replace' or strip surrogates"
        ) from None


def check_documents(documents: Sequence[object], what: str = "documents") -> None:
    """Reject documents the tokenizer cannot read (each named by its index)."""
    for i, document in enumerate(documents):
        check_text(document, f"{what}[{i}]")


def check_device(device: str) -> None:
    """Fail early, and clearly, when the settings name a device this machine lacks.

    Raises:
        InvalidInputError: No such device here.
    """
    kind = device.split(":", 1)[0]
    available = {
        "cpu": True,
        "cuda": torch.cuda.is_available(),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
        "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if not available.get(kind, False):
        raise InvalidInputError(f"device={device!r} but this machine has no {kind} device; use device='cpu' or None")
