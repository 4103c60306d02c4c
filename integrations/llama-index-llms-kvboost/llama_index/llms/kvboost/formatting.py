"""Prompt rendering helpers: chat messages to text, and the shared beginning of a prompt.

The shared beginning is the part of a rendered prompt that many prompts have in common (the
chat template's system turn, or the system prompt of a completion prompt). Warmed once with
``KVBoost.warm``, it is served by prefix hash on every later prompt that starts with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole

logger = logging.getLogger(__name__)

#: Stands in for the first non-system message's content when locating where it starts.
SENTINEL = "KVBOOST-SENTINEL-5d1f0c7a"

#: Characters after a candidate beginning that are tokenized to check the token boundary.
BOUNDARY_PROBE_CHARS = 64

#: Trailing whitespace characters dropped at most to find a token boundary.
MAX_TRIMMED_WHITESPACE = 4

#: LlamaIndex roles that chat templates know under another name.
_ROLE_ALIASES = {
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.DEVELOPER.value: "system",
}

Renderer = Callable[[Sequence[ChatMessage], bool], str]
"""``render(messages, add_generation_prompt) -> prompt`` for one formatting scheme."""

TokenIds = Callable[[str], list[int]]


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Convert LlamaIndex messages to the ``{"role", "content"}`` dicts chat templates read.

    Args:
        messages: Chat messages; non-text blocks are dropped, text blocks joined.

    Returns:
        One dict per message, with LlamaIndex-only roles mapped to template roles.
    """
    out: list[dict[str, str]] = []
    for message in messages:
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        out.append({"role": _ROLE_ALIASES.get(role, role), "content": message.content or ""})
    return out


def _is_system(message: ChatMessage) -> bool:
    return message.role in (MessageRole.SYSTEM, MessageRole.DEVELOPER)


def _token_boundary_holds(candidate: str, prompt: str, token_ids: TokenIds) -> bool:
    """Whether ``prompt`` tokenizes to ``candidate``'s tokens followed by more tokens.

    A tokenizer may merge the last characters of ``candidate`` with the first characters
    after it; then the warmed tokens would not be a token prefix of the prompt and the prefix
    hash would miss. BPE merges are local, so a short probe past the boundary is enough.
    """
    head = token_ids(candidate)
    probe = token_ids(prompt[: len(candidate) + BOUNDARY_PROBE_CHARS])
    return bool(head) and probe[: len(head)] == head


def _on_token_boundary(candidate: str, prompt: str, token_ids: TokenIds) -> str | None:
    r"""``candidate``, or it with trailing whitespace trimmed, whichever ends on a token boundary.

    Byte-level tokenizers split a run of newlines differently when a word follows
    (``"\n\n"`` alone is one token, before ``"Context"`` it may be two), so dropping the
    trailing whitespace usually restores a clean boundary.
    """
    trimmed = 0
    while candidate and trimmed <= MAX_TRIMMED_WHITESPACE:
        if prompt.startswith(candidate) and _token_boundary_holds(candidate, prompt, token_ids):
            return candidate
        if not candidate[-1].isspace():
            break
        candidate = candidate[:-1]
        trimmed += 1
    return None


def chat_shared_beginning(
    messages: Sequence[ChatMessage],
    prompt: str,
    render: Renderer,
    token_ids: TokenIds,
) -> str | None:
    """The longest template rendering shared by every prompt with these leading messages.

    Two candidates are tried: the rendering of the leading system messages alone, and the
    rendering up to where the first non-system message's content starts (this one also
    covers templates that insert a default system turn when there is none, and the header of
    the first user turn). A candidate counts only if it is a string prefix of ``prompt`` and
    its tokens are a token prefix of ``prompt``'s tokens.

    Args:
        messages: The chat messages ``prompt`` was rendered from.
        prompt: The full rendered prompt.
        render: The renderer that produced ``prompt``.
        token_ids: The model tokenizer (no special tokens added).

    Returns:
        The shared beginning, or ``None`` when no candidate qualifies.
    """
    n_system = 0
    while n_system < len(messages) and _is_system(messages[n_system]):
        n_system += 1

    candidates: list[str] = []
    if n_system:
        candidates.append(render(messages[:n_system], False))
    if n_system < len(messages):
        first = messages[n_system]
        probe = [*messages[:n_system], ChatMessage(role=first.role, content=SENTINEL)]
        rendered = render(probe, False)
        cut = rendered.find(SENTINEL)
        if cut > 0:
            candidates.append(rendered[:cut])

    for candidate in sorted(candidates, key=len, reverse=True):
        if candidate and len(candidate) < len(prompt) and prompt.startswith(candidate):
            found = _on_token_boundary(candidate, prompt, token_ids)
            if found:
                return found
            logger.debug("shared beginning candidate rejected: tokens merge across its end")
    return None


def text_shared_beginning(system_prompt: str | None, prompt: str, token_ids: TokenIds) -> str | None:
    r"""The system prompt part of a completion prompt built as ``system + "\n\n" + rest``.

    This is how LlamaIndex prepends ``LLM.system_prompt`` to completion prompts.

    Args:
        system_prompt: The LLM's system prompt.
        prompt: The full completion prompt.
        token_ids: The model tokenizer (no special tokens added).

    Returns:
        ``system_prompt + "\n\n"`` (less trailing whitespace where the tokens merge
        across it) when ``prompt`` starts with it.
    """
    if not system_prompt:
        return None
    candidate = system_prompt + "\n\n"
    if len(prompt) > len(candidate) and prompt.startswith(candidate):
        return _on_token_boundary(candidate, prompt, token_ids)
    return None
