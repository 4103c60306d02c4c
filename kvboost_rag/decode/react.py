"""The ReAct text format on local models: its tools read from the prompt, replies constrained to it.

An agent of the ReAct kind (LlamaIndex's ``ReActAgent``) passes no tools to the model: it
describes them in its system message and parses the reply's text, one of::

    Thought: I need to use a tool to help me answer the question.
    Action: search_docs
    Action Input: {"input": "decorators"}

    Thought: I can answer without using any more tools.
    Answer: A decorator wraps a function.

A small model left free may write neither (SmolLM2-135M answered the question at once, in plain
text, without searching). :func:`react_tools` reads the tools from the system message
LlamaIndex's ``ReActChatFormatter`` writes (each tool as ``> Tool Name:`` / ``Tool
Description:`` / ``Tool Args:`` lines, and the ``Action: tool name (one of ...)`` line of its
output format), and :func:`react_constraint` constrains the reply to one step of that format:
a one-line thought, then either an action naming one of the tools with an input valid for its
argument schema, or an answer. Like every constrained output, the step closes within
``max_new_tokens``. :func:`react_call_format` puts the two together for an adapter: given a
conversation's system text, the constraint of its reply, or ``None`` when it is no ReAct prompt.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from kvboost_rag.decode.constrained import JSON_LAYOUT, OutputConstraint
from kvboost_rag.decode.tool_calls import CallFormat, ToolSpec, closed_schema
from kvboost_rag.errors import InvalidInputError

logger = logging.getLogger(__name__)

#: The line of the ReAct output format that names the tools; its presence marks a ReAct prompt.
FORMAT_MARKER = re.compile(r"^Action: tool name \(one of (?P<names>.*)\) if using a tool\.$", re.M)

#: How the agent starts a message holding a tool's output.
OBSERVATION = "Observation:"

#: The kinds of step :func:`react_constraint` allows: an action or an answer, an action, an answer.
ANY_STEP, ACTION, ANSWER = "any", "action", "answer"

#: One tool's description: its name, then (after a description of any length) its argument schema.
_TOOL = re.compile(
    r"^> Tool Name: (?P<name>[^\n]+)$(?:(?!^> Tool Name: ).)*?^Tool Args: (?P<args>[^\n]*)$", re.M | re.S
)


def react_tools(system_text: str) -> list[ToolSpec] | None:
    """The tools a ReAct system message describes, or ``None`` when ``system_text`` is not one.

    A tool whose ``Tool Args`` line is not a JSON object schema takes any JSON object. Tools the
    format line names but no description gives are left out.
    """
    marker = FORMAT_MARKER.search(system_text)
    if marker is None:
        return None
    names = [name.strip() for name in marker.group("names").split(",") if name.strip()]
    schemas: dict[str, dict[str, Any]] = {}
    for match in _TOOL.finditer(system_text):
        try:
            schema = json.loads(match.group("args"))
        except json.JSONDecodeError:
            schema = None
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            schema = {"type": "object"}
        schemas.setdefault(match.group("name").strip(), schema)
    specs = [ToolSpec(name, "", schemas[name]) for name in names if name in schemas]
    if len(specs) < len(names):
        logger.debug("ReAct prompt: no argument schema found for %s", sorted(set(names) - set(schemas)))
    return specs


def react_constraint(specs: Sequence[ToolSpec], step: str = ANY_STEP) -> OutputConstraint:
    """One ReAct step: ``Thought: <one line>`` then ``Action: <tool>`` and ``Action Input: <its
    arguments as JSON>`` (an :data:`ACTION` step), or ``Answer: <text>`` (an :data:`ANSWER`
    step), or either (:data:`ANY_STEP`).

    Raises:
        InvalidInputError: No tools, or an unknown ``step``.
    """
    if not specs:
        raise InvalidInputError("a ReAct constraint needs at least one tool")
    if step not in (ANY_STEP, ACTION, ANSWER):
        raise InvalidInputError(f"step must be {ANY_STEP!r}, {ACTION!r} or {ANSWER!r}, got {step!r}")
    actions = []
    rules = []
    for i, spec in enumerate(specs):
        schema = {**closed_schema(spec.parameters), "x-guidance": JSON_LAYOUT}
        actions.append(f"action_{i}")
        rules.append(f"action_{i}: {json.dumps(spec.name + chr(10) + 'Action Input: ')} input_{i}")
        rules.append(f"input_{i}: %json {json.dumps(schema)}")
    then = {ANY_STEP: "(action | answer)", ACTION: "action", ANSWER: "answer"}[step]
    grammar = "\n".join(
        [
            f'start: "Thought: " THOUGHT "\\n" {then}',
            f'action: "Action: " ({" | ".join(actions)})',
            'answer: "Answer: " ANSWER',
            *rules,
            r"THOUGHT: /[^\s][^\n]*/",
            r"ANSWER: /[^\s][\s\S]*/",
        ]
    )
    return OutputConstraint(grammar=grammar + "\n")


def observations_since_question(messages: Sequence[tuple[str, str]]) -> int:
    """How many tool observations follow the last user question in ``messages`` (``(role,
    text)`` pairs after the system message; the agent sends observations as user messages
    starting with ``Observation:``)."""
    count = 0
    for role, text in reversed(messages):
        if text.lstrip().startswith(OBSERVATION):
            count += 1
        elif role == "user":
            break
    return count


def react_call_format(
    system_text: str | None, messages: Sequence[tuple[str, str]] = (), tool_steps: int | None = None
) -> CallFormat | None:
    """The output format of a reply to a ReAct prompt: text (nothing parsed as tool calls: the
    agent parses it) constrained to one ReAct step.

    Args:
        system_text: The conversation's system message.
        messages: The conversation after it, as ``(role, text)`` pairs.
        tool_steps: ``None``: the model chooses to act or answer at every step. ``n``: the
            first ``n`` steps after a question act (call a tool), the next one answers: for
            tool calls, what ``FunctionAgent(initial_tool_choice=...)`` does for the first step;
            a small model left to choose tends to answer before searching, or to search again
            and again.

    Returns:
        The format, or ``None`` when ``system_text`` is no ReAct system message or describes
        no tool.
    """
    specs = react_tools(system_text or "")
    if not specs:
        return None
    step = ANY_STEP
    if tool_steps is not None:
        step = ACTION if observations_since_question(messages) < tool_steps else ANSWER
    return CallFormat(constraint=react_constraint(specs, step))
