"""Prompt rendering: chat messages to template dicts, and nodes to the text prompts hold.

This module imports no other module of the package: prewarm and retrieval (which need
``node_prompt_text``), base (which reads ``documents=`` through ``NODE_DOCUMENTS``) and
rendering (which needs ``message_dicts``) import it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from kvboost_rag.integration.params import DocumentConverter

logger = logging.getLogger(__name__)

#: LlamaIndex roles that chat templates know under another name.
_ROLE_ALIASES = {
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.DEVELOPER.value: "system",
}


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Convert LlamaIndex messages to the ``{"role", "content"}`` dicts chat templates read.

    Args:
        messages: Chat messages; non-text blocks are dropped, text blocks joined. Assistant
            tool calls (``additional_kwargs["tool_calls"]`` or ``ToolCallBlock``s) and a tool
            result's ``tool_call_id`` are kept in the OpenAI layout templates read.

    Returns:
        One dict per message, with LlamaIndex-only roles mapped to template roles.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        entry: dict[str, Any] = {"role": _ROLE_ALIASES.get(role, role), "content": message.content or ""}
        calls = _tool_calls(message)
        if calls:
            entry["tool_calls"] = calls
        if "tool_call_id" in message.additional_kwargs:
            entry["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        out.append(entry)
    return out


def _tool_calls(message: ChatMessage) -> list[dict[str, Any]]:
    calls = list(message.additional_kwargs.get("tool_calls") or [])
    for block in message.blocks:
        if isinstance(block, ToolCallBlock):
            arguments = block.tool_kwargs
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    arguments = {"raw": arguments}
            calls.append(
                {"id": block.tool_call_id, "type": "function", "function": {"name": block.tool_name, "arguments": arguments}}
            )
    return calls


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


def _document_text(item: Any) -> str | None:
    if isinstance(item, NodeWithScore):
        return node_prompt_text(item.node)
    if isinstance(item, BaseNode):
        return node_prompt_text(item)
    return None


#: Nodes (``Document``, ``TextNode``, ``NodeWithScore``) in ``documents=`` stand for the text
#: response synthesizers put in prompts.
NODE_DOCUMENTS = DocumentConverter(_document_text, "str, a node or a NodeWithScore")
