"""Whether a rendered shared beginning ends on a token boundary of the full prompt.

A shared beginning (a system prompt, a chat template's system turn) is warmed with
``KVBoost.warm`` and then found in later prompts by a hash of its token prefix. That only
works when the prompt's tokens start with exactly the beginning's tokens. Two things can
break it even when the beginning is a string prefix of the prompt:

* the tokenizer merges the last characters of the beginning with the first characters after
  it (``"def func"`` + ``"tion"`` tokenizes as ``" function"``, not ``" f" "un" "c" ...``);
* byte-level tokenizers split a run of whitespace differently when a word follows it
  (``"\\n\\n"`` alone is one token, before ``"Context"`` it may be two).

The first cannot be repaired; the second usually can, by dropping a few trailing whitespace
characters. BPE merges are local, so a short probe of the prompt past the boundary is enough
to check it: the whole prompt never needs to be tokenized.

The functions here are pure: they take the candidate text, the full prompt and a
``token_ids(text) -> list[int]`` callable (the model tokenizer, no special tokens added).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

#: Characters of the prompt past a candidate beginning that are tokenized to check its end.
BOUNDARY_PROBE_CHARS = 64

#: Trailing whitespace characters dropped at most to find a token boundary.
MAX_TRIMMED_WHITESPACE = 4

TokenIds = Callable[[str], Sequence[int]]
"""``token_ids(text) -> ids`` under the model's tokenizer, no special tokens added."""


def token_boundary_holds(candidate: str, prompt: str, token_ids: TokenIds) -> bool:
    """Whether ``prompt`` tokenizes to ``candidate``'s tokens followed by more tokens.

    Only ``prompt``'s first ``len(candidate) + BOUNDARY_PROBE_CHARS`` characters are
    tokenized: a merge across the boundary can only involve characters near it.

    Args:
        candidate: A string prefix of ``prompt``.
        prompt: The full prompt.
        token_ids: The model tokenizer (no special tokens added).

    Returns:
        ``True`` when ``candidate`` is non-empty, a string prefix of ``prompt``, and its
        tokens are a token prefix of ``prompt``'s tokens.
    """
    if not candidate or not prompt.startswith(candidate):
        return False
    head = list(token_ids(candidate))
    probe = list(token_ids(prompt[: len(candidate) + BOUNDARY_PROBE_CHARS]))
    return bool(head) and probe[: len(head)] == head


def on_token_boundary(
    candidate: str,
    prompt: str,
    token_ids: TokenIds,
    max_trimmed_whitespace: int = MAX_TRIMMED_WHITESPACE,
) -> str | None:
    r"""``candidate``, or it less some trailing whitespace, whichever ends on a token boundary.

    Args:
        candidate: A rendered shared beginning.
        prompt: The full prompt; ``candidate`` must be a proper string prefix of it (a prompt
            that is only its beginning has nothing to share).
        token_ids: The model tokenizer (no special tokens added).
        max_trimmed_whitespace: Trailing whitespace characters dropped at most.

    Returns:
        The longest of ``candidate``, ``candidate[:-1]``, ... (dropping only whitespace, at
        most ``max_trimmed_whitespace`` characters) whose tokens are a token prefix of
        ``prompt``; ``None`` when there is none.
    """
    if not candidate or len(candidate) >= len(prompt) or not prompt.startswith(candidate):
        return None
    trimmed = 0
    while candidate and trimmed <= max_trimmed_whitespace:
        if token_boundary_holds(candidate, prompt, token_ids):
            return candidate
        if not candidate[-1].isspace():
            break
        candidate = candidate[:-1]
        trimmed += 1
    return None


def longest_shared_beginning(
    candidates: Iterable[str | None],
    prompt: str,
    token_ids: TokenIds,
) -> str | None:
    """The longest candidate that ends (after trimming whitespace) on a token boundary of ``prompt``.

    Args:
        candidates: Renderings that may be the shared beginning of ``prompt`` (``None`` and
            empty ones are ignored).
        prompt: The full prompt.
        token_ids: The model tokenizer (no special tokens added).

    Returns:
        What :func:`on_token_boundary` returns for the longest candidate that qualifies, or
        ``None``.
    """
    for candidate in sorted((c for c in candidates if c), key=len, reverse=True):
        if not prompt.startswith(candidate):
            logger.debug("shared beginning candidate rejected: it is not a prefix of the prompt")
            continue
        found = on_token_boundary(candidate, prompt, token_ids)
        if found:
            return found
        logger.debug("shared beginning candidate rejected: tokens merge across its end")
    return None
