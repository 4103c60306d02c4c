"""Prompt rendering: chat messages and nodes to prompt text, and the shared beginning of a prompt.

This module imports no other module of the package: prewarm and retrieval (which need
``node_prompt_text``) and base (which needs the rest) import it.

The shared beginning is the part of a rendered prompt that many prompts have in common (the
chat template's system turn, or the system prompt of a completion prompt). Warmed with
``KVBoost.warm``, it is served by prefix hash on every later prompt that starts with it.
Whether a candidate ends on a token boundary is decided by ``kvboost_rag.shared_beginning``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.schema import BaseNode, MetadataMode

from kvboost_rag.shared_beginning import TokenIds, longest_shared_beginning, on_token_boundary

logger = logging.getLogger(__name__)

#: Stands in for the first non-system message's content when locating where it starts.
SENTINEL = "KVBOOST-SENTINEL-5d1f0c7a"

#: LlamaIndex roles that chat templates know under another name.
_ROLE_ALIASES = {
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.DEVELOPER.value: "system",
}

Renderer = Callable[[Sequence[ChatMessage], bool], str]
"""``render(messages, add_generation_prompt) -> prompt`` for one formatting scheme."""



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

    return longest_shared_beginning(candidates, prompt, token_ids)


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
    return on_token_boundary(system_prompt + "\n\n", prompt, token_ids)


def node_prompt_text(node: BaseNode) -> str:
    """The text of ``node`` as response synthesizers put it in prompts.

    Synthesizers read ``node.get_content(metadata_mode=MetadataMode.LLM)`` and strip each
    chunk before joining, so the stripped text is what a prompt contains.

    Args:
        node: A LlamaIndex node.

    Returns:
        The stripped LLM-mode content (empty for nodes without text).
    """
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()
