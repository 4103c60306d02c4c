"""Tool calls on local models: prompt rendering, the decoding constraint, and parsing.

Framework-free; both integrations use it. A tool call is written as Hermes-style text, the
format Qwen2.5/Qwen3, SmolLM3 and Hermes chat templates teach their models::

    <tool_call>
    {"name": "search_docs", "arguments": {"query": "decorators"}}
    </tool_call>

Tools reach the prompt through the chat template's ``tools=`` when the template renders them
(``KVBoost.chat_template_renders_tools``); otherwise :func:`tools_instructions` writes them
into the system message (the fallback format). Decoding is constrained by
:func:`tool_choice_constraint`:

- ``"required"`` (also ``"any"``, ``True``) or a tool's name: the output is one tool call,
  its name one of the tools (or that tool) and its arguments valid for the tool's schema;
- ``"auto"``: either one such tool call, or plain text that does not start with ``<`` (so text
  and a call can never be confused);
- ``"none"``: plain text that does not start with ``<`` (the tools stay in the prompt, so its
  cached K/V is the same as for the other choices).

With ``parallel`` (LangChain's ``parallel_tool_calls``, LlamaIndex's
``allow_parallel_tool_calls``) "one tool call" above reads "one or more tool calls", one per
line; each parsed call gets its own id. Like every constrained output, the calls close within
``max_new_tokens`` (see :mod:`kvboost_rag.decode.constrained`): another call starts only if it can end.

Object schemas without ``additionalProperties`` are closed (no keys beyond ``properties``)
before compiling: extra arguments serve no tool, and an open object lets a weak model add keys
until its token budget ends.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvboost_rag.decode.constrained import JSON_LAYOUT, OutputConstraint
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.log_limits import RateLimitedLogger

logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(logger)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

#: Normalized tool choices besides a tool's name.
AUTO, REQUIRED, NONE = "auto", "required", "none"

_CALL_PATTERN = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model sees it.

    Attributes:
        name: The name calls use.
        description: What it does.
        parameters: JSON schema of its arguments (an object schema).
    """

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """Read an OpenAI-style ``{"type": "function", "function": {...}}`` definition.

        Raises:
            InvalidInputError: No function name, or parameters that are not an object schema.
        """
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidInputError(
                f"a tool must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, got {tool!r}"
            )
        parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        if parameters.get("type", "object") != "object":
            raise InvalidInputError(
                f"tool {function['name']!r}: parameters must be a JSON object schema, got type {parameters.get('type')!r}"
            )
        return cls(str(function["name"]), str(function.get("description") or ""), parameters)

    def openai(self) -> dict[str, Any]:
        """The OpenAI-style definition chat templates read."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """``ToolSpec`` of each OpenAI-style tool definition, one per name.

    Tools given twice under one name (a pydantic model and its JSON schema, say) count once:
    the last definition wins, and a warning says so when the definitions differ.

    Raises:
        InvalidInputError: A malformed definition.
    """
    by_name: dict[str, ToolSpec] = {}
    for tool in tools:
        spec = ToolSpec.from_openai(tool)
        if spec.name in by_name and by_name[spec.name] != spec:
            _warnings.warning(
                "duplicate-tool",
                "two different tools are named %r; the last one given is used: rename one to keep both",
                spec.name,
            )
        by_name.pop(spec.name, None)
        by_name[spec.name] = spec
    return list(by_name.values())


def normalize_tool_choice(choice: Any, names: Sequence[str]) -> str:
    """``"auto"``, ``"required"``, ``"none"`` or one tool's name.

    Accepts ``None`` (auto), ``"auto"``, ``"any"``/``"required"``/``True`` (required),
    ``"none"``/``False``, a tool name, and ``{"type": "function", "function": {"name": ...}}``.

    Raises:
        InvalidInputError: A name that is not one of the tools, or a value of another kind.
    """
    if choice is None or choice == AUTO:
        return AUTO
    if choice is True or choice in ("any", REQUIRED):
        return REQUIRED
    if choice is False or choice == NONE:
        return NONE
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise InvalidInputError(
        f"tool_choice={choice!r} is not one of the bound tools {list(names)}; use one of those names, "
        "'auto', 'any'/'required' or 'none'"
    )


def closed_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` where every object schema with ``properties`` and no
    ``additionalProperties`` allows no other keys."""
    result = copy.deepcopy(dict(schema))

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(result)
    return result


def call_schema(spec: ToolSpec) -> dict[str, Any]:
    """JSON schema of one call of ``spec``: its name, then its arguments (the arguments'
    ``$defs`` move to the root, where their ``#/$defs/...`` references point)."""
    arguments = closed_schema(spec.parameters)
    definitions = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": spec.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
        "x-guidance": JSON_LAYOUT,
    }


def tool_choice_constraint(specs: Sequence[ToolSpec], choice: str, parallel: bool = False) -> OutputConstraint:
    """The decoding constraint of a normalized ``choice`` over ``specs`` (see the module doc).

    Args:
        specs: The bound tools.
        choice: A normalized tool choice (:func:`normalize_tool_choice`).
        parallel: Allow one or more calls, one per line, where one call is allowed.

    Raises:
        InvalidInputError: ``"required"`` or a name with no tools.
    """
    text_rule = r"TEXT: /[^<\s][\s\S]*/"
    if choice == NONE or not specs and choice == AUTO:
        return OutputConstraint(grammar=f"start: TEXT\n{text_rule}\n")
    chosen = [s for s in specs if choice in (AUTO, REQUIRED) or s.name == choice]
    if not chosen:
        raise InvalidInputError(f"tool_choice={choice!r} needs at least one bound tool: pass tools to bind_tools")
    # One %json rule per tool: each schema keeps its own root for its references.
    rules = [f"call_{i}: %json {json.dumps(call_schema(s))}" for i, s in enumerate(chosen)]
    body = " | ".join(f"call_{i}" for i in range(len(chosen)))
    calls = f"calls: call ({json.dumps(chr(10))} call)*\n" if parallel else "calls: call\n"
    calls += f"call: {json.dumps(CALL_OPEN + chr(10))} ({body}) {json.dumps(chr(10) + CALL_CLOSE)}\n"
    calls += "\n".join(rules) + "\n"
    if choice == AUTO:
        return OutputConstraint(grammar=f"start: TEXT | calls\n{text_rule}\n{calls}")
    return OutputConstraint(grammar=f"start: calls\n{calls}")


@dataclass(frozen=True)
class CallFormat:
    """What one chat call's output must be: the tools in its prompt and its constraint.

    Attributes:
        specs: Tools shown in the prompt (empty: none).
        constraint: The decoding constraint (``None``: free text).
        instructions: Text for the system message saying what to reply (the JSON schema of a
            structured output: the constraint enforces it, and a model that reads it writes
            sensible values instead of filling the shape blindly).
        parallel: Several tool calls may come in one reply.
    """

    specs: tuple[ToolSpec, ...] = ()
    constraint: OutputConstraint | None = None
    instructions: str = ""
    parallel: bool = False

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.specs)


def call_format(
    tools: Sequence[Mapping[str, Any]] | None = None,
    choice: Any = None,
    response_format: Mapping[str, Any] | None = None,
    parallel: bool = False,
) -> CallFormat:
    """The tools and constraint of one call.

    Args:
        tools: OpenAI-style tool definitions.
        choice: A tool choice (see :func:`normalize_tool_choice`).
        response_format: An OpenAI-style response format (see
            :func:`response_format_constraint`); it wins over the tool choice.
        parallel: Allow several tool calls in one reply (see :func:`tool_choice_constraint`).

    Raises:
        InvalidInputError: Malformed tools, a choice naming no tool, a bad response format.
    """
    specs = tuple(tool_specs(tools or []))
    if response_format is not None:
        constraint = response_format_constraint(response_format)
        return CallFormat(specs, constraint, format_instructions(response_format, constraint))
    if not specs and choice is None:
        return CallFormat()
    normalized = normalize_tool_choice(choice, [s.name for s in specs])
    return CallFormat(specs, tool_choice_constraint(specs, normalized, parallel), parallel=parallel)


def response_format_constraint(response_format: Mapping[str, Any]) -> OutputConstraint:
    """The constraint of an OpenAI-style ``response_format``.

    Accepts ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` and
    ``{"type": "json_object"}`` (any JSON object), which may carry the ``"schema"`` the caller
    will parse the object with: decoding then follows that schema too (JSON mode with a known
    schema; the schema is not shown in the prompt). Schemas' objects are closed (see the module
    doc).

    Raises:
        InvalidInputError: Any other value.
    """
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "json_object":
        schema = response_format.get("schema")
        if isinstance(schema, Mapping):
            return OutputConstraint.from_json_schema(closed_schema(schema))
        return OutputConstraint.any_json_object()
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, Mapping):
            return OutputConstraint.from_json_schema(closed_schema(schema))
    raise InvalidInputError(
        f"response_format={response_format!r} is not supported; use {{'type': 'json_object'}} or "
        "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}"
    )


def format_instructions(response_format: Mapping[str, Any], constraint: OutputConstraint) -> str:
    """What the system message says about a structured output's format (JSON mode: only that
    it is a JSON object; the caller's prompt describes the shape)."""
    if response_format.get("type") == "json_object" or constraint.json_schema is None:
        return "Reply with only a JSON object."
    return "Reply with only a JSON object valid for this JSON schema:\n" + json.dumps(
        constraint.json_schema, ensure_ascii=False
    )


def with_system_text(messages: Sequence[Mapping[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` appended to the system message (one is added first when
    there is none)."""
    out = [dict(m) for m in messages]
    if not text:
        return out
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def tools_instructions(specs: Sequence[ToolSpec], parallel: bool = False) -> str:
    """The fallback format: tools described in the system message, for chat templates that
    do not render ``tools=`` (``parallel``: several calls may come in one reply)."""
    how = (
        "You may call one or more of the tools below. To call tools, reply with only one such block per call:"
        if parallel
        else "You may call one of the tools below. To call a tool, reply with only:"
    )
    lines = [
        "# Tools",
        "",
        how,
        CALL_OPEN,
        '{"name": <tool name>, "arguments": <arguments as a JSON object>}',
        CALL_CLOSE,
        f"A tool's result comes back in {RESPONSE_OPEN}...{RESPONSE_CLOSE}. To answer without a tool, reply "
        "with plain text.",
        "",
        "Available tools (name, description, JSON schema of the arguments):",
    ]
    for spec in specs:
        lines.append(
            json.dumps(
                {"name": spec.name, "description": spec.description, "parameters": spec.parameters}, ensure_ascii=False
            )
        )
    return "\n".join(lines)


def call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call written the way the constraint makes the model write it."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def response_text(content: str) -> str:
    """A tool's result as the fallback format shows it."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], specs: Sequence[ToolSpec], parallel: bool = False
) -> list[dict[str, Any]]:
    """Chat messages for a template that does not render tools: the tools' description
    appended to the system message (a system message is added when there is none), assistant
    tool calls written out as text, tool results wrapped in ``<tool_response>`` tags.

    Args:
        messages: Dicts in the OpenAI layout (assistant ``tool_calls``; ``tool`` role results).
        specs: The bound tools (none: only the history is rewritten).
        parallel: Several calls may come in one reply (see :func:`tools_instructions`).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = str(message.get("content") or "")
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], _arguments(c["function"].get("arguments"))) for c in message["tool_calls"]
            ]
            content = "\n".join([content, *calls]) if content else "\n".join(calls)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "tool", "content": response_text(content)})
        else:
            out.append({"role": role, "content": content})
    return with_system_text(out, tools_instructions(specs, parallel)) if specs else out


class ChatRenderer(Protocol):
    """What renders a chat (the engine has it)."""

    @property
    def chat_template_renders_tools(self) -> bool: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str: ...


def render_chat(
    engine: ChatRenderer,
    messages: Sequence[Mapping[str, Any]],
    call_format: CallFormat,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's rendering of ``messages`` with ``call_format``'s instructions and
    tools: through the template's ``tools=`` when it shows them, else in the fallback format
    (:func:`fallback_messages`, also used for a tool-call history when no tool is bound).

    Args:
        engine: The engine whose chat template renders the messages.
        messages: Dicts in the OpenAI layout.
        call_format: The call's tools, tool choice and response format.
        add_generation_prompt: Append the opening of the assistant's turn.
    """
    dicts = with_system_text(messages, call_format.instructions)
    if engine.chat_template_renders_tools:
        tools = [spec.openai() for spec in call_format.specs] or None
        return engine.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tools=tools)
    if call_format.specs or any("tool_calls" in d or d.get("role") == "tool" for d in dicts):
        dicts = fallback_messages(dicts, call_format.specs, call_format.parallel)
    return engine.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt)


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError:
            return {"raw": value}
    return dict(value or {})


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from generated text.

    Attributes:
        id: A new unique id (``call_`` + 24 hex digits).
        name: Tool name (``None`` when unreadable).
        arguments: Parsed arguments (``None`` when unreadable).
        raw: The call's JSON text.
        error: Why it could not be read (``None`` for a valid call).
    """

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None


@dataclass(frozen=True)
class ParsedOutput:
    """Generated text split into the text before any call and the calls."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def valid_calls(self) -> list[ParsedCall]:
        """Calls with a name and arguments."""
        return [c for c in self.calls if c.error is None]

    @property
    def invalid_calls(self) -> list[ParsedCall]:
        """Calls that could not be read (e.g. cut by ``max_new_tokens``)."""
        return [c for c in self.calls if c.error is not None]


def new_call_id() -> str:
    """A unique tool-call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, finish_reason: str | None = None) -> ParsedOutput:
    """Split generated ``text`` into content and tool calls.

    Args:
        text: The model's output.
        finish_reason: The engine's finish reason; ``"length"`` names ``max_new_tokens`` as
            the cause of an unfinished call.
    """
    start = text.find(CALL_OPEN)
    if start < 0:
        stripped = text.strip()
        if stripped and CALL_OPEN.startswith(stripped):  # the opening tag itself was cut
            return ParsedOutput("", [_read_call("", finish_reason)])
        return ParsedOutput(text)
    calls = []
    for match in _CALL_PATTERN.finditer(text, start):
        raw = match.group(1)
        calls.append(_read_call(raw, finish_reason))
    return ParsedOutput(text[:start].strip(), calls)


def _read_call(raw: str, finish_reason: str | None) -> ParsedCall:
    cut = " (the output reached max_new_tokens first: raise max_new_tokens)" if finish_reason == "length" else ""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ParsedCall(new_call_id(), None, None, raw, f"tool call is not valid JSON: {exc}{cut}")
    name = data.get("name") if isinstance(data, dict) else None
    arguments = data.get("arguments", {}) if isinstance(data, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return ParsedCall(new_call_id(), name if isinstance(name, str) else None, None, raw,
                          'a tool call must be {"name": <string>, "arguments": <object>}')
    return ParsedCall(new_call_id(), name, arguments, raw)
