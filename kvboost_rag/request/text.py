"""Text to tokens: the first step of every prompt, document and warmed beginning."""

from __future__ import annotations

from typing import Any

from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.errors import InvalidInputError, PromptTooLongError
from kvboost_rag.request.inputs import check_text
from kvboost_rag.request.plan import PromptTokens


class Tokenizing:
    """Tokenizes text for the engine, the way full prefill sees it.

    Args:
        tokenizer: The model's fast tokenizer.
        model: Anything with a ``context_window`` (the model adapter), read at each prompt so
            it follows the model's config.
    """

    def __init__(self, tokenizer: Any, model: Any) -> None:
        self.tokenizer = tokenizer
        self._model = model

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def ids_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and character spans of ``text`` tokenized alone (no special tokens)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def prompt(self, text: str, what: str = "prompt") -> PromptTokens:
        """A prompt's tokens exactly as full prefill sees them (special tokens included).

        Raises:
            InvalidInputError: Blank or unreadable text, or no tokens.
            PromptTooLongError: It does not fit the context window.
        """
        check_text(text, what)
        with stage("tokenize"):
            enc = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            offsets = [tuple(o) for o in enc["offset_mapping"]]
        if not ids:
            raise InvalidInputError(f"{what} has no tokens")
        window = self._model.context_window
        if len(ids) >= window:
            raise PromptTooLongError(
                f"{what} has {len(ids)} tokens but the model's context window is {window}: "
                "retrieve fewer or shorter documents"
            )
        return PromptTokens(text, ids, offsets)
