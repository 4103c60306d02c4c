"""Prompt rendering: chat messages to template dicts, and nodes to the text prompts hold.

This module imports no other module of the package: prewarm and retrieval (which need
``node_prompt_text``) and base (which needs ``message_dicts``) import it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.schema import BaseNode, MetadataMode

logger = logging.getLogger(__name__)

#: LlamaIndex roles that chat templates know under another name.
_ROLE_ALIASES = {
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.DEVELOPER.value: "system",
}


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
