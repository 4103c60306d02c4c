"""A chat call's tool and output-format keywords, one set of names for both integrations.

LangChain binds ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format``;
LlamaIndex passes ``tools``, ``tool_choice``, ``tool_required``,
``allow_parallel_tool_calls`` and ``response_format``. Both accept all of them:
:func:`pop_call_format` takes them out of a call's keyword arguments and returns the
:class:`~kvboost_rag.decode.tool_calls.CallFormat` of the call (tools in the prompt, decoding
constraint).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvboost_rag.decode.tool_calls import REQUIRED, CallFormat, call_format
from kvboost_rag.errors import InvalidInputError

#: The keywords :func:`pop_call_format` takes.
TOOL_PARAMETERS = (
    "tools",
    "tool_choice",
    "tool_required",
    "parallel_tool_calls",
    "allow_parallel_tool_calls",
    "response_format",
)


def _same_tool(tool: Any) -> Mapping[str, Any]:
    return tool


def pop_call_format(
    kwargs: dict[str, Any],
    convert_tool: Callable[[Any], Mapping[str, Any]] = _same_tool,
) -> CallFormat:
    """Take the tool and output-format keywords out of ``kwargs``.

    Args:
        kwargs: A call's keyword arguments; the keywords of :data:`TOOL_PARAMETERS` are
            removed from it.
        convert_tool: Turns one tool as the framework passes it (a LangChain tool, a
            LlamaIndex ``BaseTool``, a pydantic model, ...) into an OpenAI-style definition;
            by default tools are taken to be such definitions already.

    Returns:
        The call's format. ``tool_choice`` wins over ``tool_required`` (which means
        ``tool_choice="required"``); ``parallel_tool_calls`` and ``allow_parallel_tool_calls``
        are two names for one setting (one or more calls per reply); ``response_format`` wins
        over the tool choice.

    Raises:
        InvalidInputError: Malformed tools, a ``tool_choice`` that names no tool, a
            ``response_format`` of another kind, or the two parallel-call names set to
            different values.
    """
    tools = kwargs.pop("tools", None)
    choice = kwargs.pop("tool_choice", None)
    if kwargs.pop("tool_required", False) and choice is None:
        choice = REQUIRED
    parallel = kwargs.pop("parallel_tool_calls", None)
    allow = kwargs.pop("allow_parallel_tool_calls", None)
    if parallel is not None and allow is not None and bool(parallel) != bool(allow):
        raise InvalidInputError(
            f"parallel_tool_calls={parallel!r} and allow_parallel_tool_calls={allow!r} conflict: they are "
            "two names for one setting; set only one."
        )
    response_format = kwargs.pop("response_format", None)
    definitions = [convert_tool(tool) for tool in tools or []]
    return call_format(definitions, choice, response_format, bool(parallel if parallel is not None else allow))
