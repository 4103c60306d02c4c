"""Function calling for ``KVBoostLLM``: LlamaIndex tools to OpenAI-style definitions, and
generated text back to tool calls (``additional_kwargs["tool_calls"]``).

The per-call tool keywords are read by :mod:`kvboost_rag.integration.tool_arguments`; the
prompt side and the grammar of each tool choice live in :mod:`kvboost_rag.decode.tool_calls`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms.llm import ToolSelection

from kvboost_rag import InvalidInputError
from kvboost_rag.integration import REQUIRED, CallFormat, parse_tool_calls

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool


def chat_with_tools_arguments(
    tools: Sequence[BaseTool],
    user_msg: str | ChatMessage | None,
    chat_history: list[ChatMessage] | None,
    tool_required: bool,
    kwargs: dict[str, Any],
    allow_parallel_tool_calls: bool = False,
) -> dict[str, Any]:
    """The ``chat`` arguments of ``chat_with_tools``: the messages, the tools as OpenAI-style
    definitions, the tool choice (``tool_choice`` from ``kwargs`` wins over
    ``tool_required``) and whether one reply may hold several calls."""
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
    if user_msg is not None:
        messages.append(user_msg)
    choice = kwargs.pop("tool_choice", None)
    if choice is None and tool_required:
        choice = REQUIRED
    return {
        "messages": messages,
        "tools": [openai_tool(tool) for tool in tools],
        "tool_choice": choice,
        "allow_parallel_tool_calls": allow_parallel_tool_calls,
        **kwargs,
    }


def openai_tool(tool: Any) -> Mapping[str, Any]:
    """The OpenAI-style definition of a tool given as a LlamaIndex ``BaseTool`` or as a definition.

    Raises:
        InvalidInputError: Neither.
    """
    if isinstance(tool, Mapping):
        return tool
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not callable(getattr(metadata, "to_openai_tool", None)):
        raise InvalidInputError(
            f"a tool must be a LlamaIndex BaseTool or an OpenAI-style definition, got {type(tool).__name__}"
        )
    return metadata.to_openai_tool()


def assistant_message(text: str, finish_reason: str, output_format: CallFormat) -> ChatMessage:
    """The assistant's reply: text, and its tool calls when tools were bound (valid ones in
    ``additional_kwargs["tool_calls"]``, unreadable ones, such as a call cut by
    ``max_new_tokens``, in ``additional_kwargs["invalid_tool_calls"]``)."""
    if not output_format.parses_tool_calls:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    parsed = parse_tool_calls(text, finish_reason)
    extra: dict[str, Any] = {}
    if parsed.valid_calls:
        extra["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.valid_calls
        ]
    if parsed.invalid_calls:
        extra["invalid_tool_calls"] = [{"id": c.id, "raw": c.raw, "error": c.error} for c in parsed.invalid_calls]
    return ChatMessage(role=MessageRole.ASSISTANT, content=parsed.content, additional_kwargs=extra)


def tool_selections(message: ChatMessage, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The tool calls of an assistant message.

    Raises:
        ValueError: No tool call and ``error_on_no_tool_call`` (the reason is named when the
            call was cut).
    """
    calls = message.additional_kwargs.get("tool_calls") or []
    if not calls and error_on_no_tool_call:
        invalid = message.additional_kwargs.get("invalid_tool_calls") or []
        reason = f": {invalid[0]['error']}" if invalid else ""
        raise ValueError(f"expected at least one tool call in the response{reason}")
    return [
        ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"], tool_kwargs=c["function"]["arguments"])
        for c in calls
    ]
