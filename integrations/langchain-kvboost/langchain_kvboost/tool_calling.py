"""Tool calling and structured output for ``ChatKVBoost``: per-call tool and format arguments
to a decoding constraint, and generated text back to LangChain tool calls.

The prompt side (tools in the chat template, or the fallback system-message format) and the
grammar of each ``tool_choice`` live in :mod:`kvboost_rag.decode.tool_calls`; this module only
translates between them and LangChain's types.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from operator import itemgetter
from typing import Any

from kvboost_rag import InvalidInputError
from kvboost_rag.integration import CallFormat, ParsedOutput, parse_tool_calls
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import (
    convert_to_json_schema,
    convert_to_openai_tool,
)
from langchain_core.utils.pydantic import is_basemodel_subclass

#: ``with_structured_output`` methods.
STRUCTURED_METHODS = ("json_schema", "function_calling", "json_mode")


def ai_message(text: str, finish_reason: str, output_format: CallFormat, **fields: Any) -> AIMessage:
    """The reply to one call: text, or tool calls when tools were bound."""
    if not output_format.parses_tool_calls:
        return AIMessage(content=text, **fields)
    parsed = parse_tool_calls(text, finish_reason)
    return AIMessage(
        content=parsed.content,
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in parsed.valid_calls],
        invalid_tool_calls=[
            invalid_tool_call(name=c.name, args=c.raw, id=c.id, error=c.error) for c in parsed.invalid_calls
        ],
        **fields,
    )


def tool_call_chunks(parsed: ParsedOutput) -> list[Any]:
    """Streamed tool calls, one whole chunk per call."""
    return [
        tool_call_chunk(name=c.name, args=json.dumps(c.arguments) if c.error is None else c.raw, id=c.id, index=i)
        for i, c in enumerate(parsed.calls)
    ]


def message_dict(message: BaseMessage, role: str, text: str) -> dict[str, Any]:
    """A chat-template dict for ``message``: assistant tool calls and tool results in the
    OpenAI layout chat templates read."""
    entry: dict[str, Any] = {"role": role, "content": text}
    if isinstance(message, AIMessage) and message.tool_calls:
        entry["tool_calls"] = [
            {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
            for c in message.tool_calls
        ]
    elif isinstance(message, ToolMessage):
        entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
    return entry


def structured_output(
    model: Any, schema: Any, method: str, include_raw: bool, strict: bool | None
) -> Runnable[Any, Any]:
    """The runnable ``with_structured_output`` returns (see ``ChatKVBoost``)."""
    if method not in STRUCTURED_METHODS:
        raise InvalidInputError(f"method={method!r} is not one of {list(STRUCTURED_METHODS)}")
    if schema is None and method != "json_mode":
        raise InvalidInputError(f"method={method!r} needs a schema: a pydantic model, a TypedDict or a JSON schema")
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        llm = model.bind_tools([schema], tool_choice=name, ls_structured_output_format=trace)
        parser: Runnable[Any, Any] = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)
            if is_pydantic
            else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        )
    else:
        if method == "json_mode":
            response_format: dict[str, Any] = {"type": "json_object"}
            if schema is not None:
                response_format["schema"] = _json_schema(schema)
        else:
            json_schema = _json_schema(schema)
            name = json_schema.get("title", "output")
            response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema}}
        if schema is None:
            trace.pop("schema")
        llm = model.bind(response_format=response_format, ls_structured_output_format=trace)
        parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
    if not include_raw:
        return llm | parser
    parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parse.with_fallbacks([fallback], exception_key="parsing_error")


def _json_schema(schema: Any) -> dict[str, Any]:
    """JSON schema of a pydantic model, a TypedDict, a JSON schema or an OpenAI tool dict.

    Raises:
        InvalidInputError: Anything else.
    """
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        if hasattr(schema, "model_json_schema"):
            return dict(schema.model_json_schema())
        return dict(schema.schema())  # pydantic.v1 models
    if isinstance(schema, Mapping) and "function" not in schema and "parameters" not in schema:
        return dict(schema)  # a JSON schema, used as given
    try:
        return dict(convert_to_json_schema(schema))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"cannot read a JSON schema from {schema!r}: pass a pydantic model, a TypedDict or a JSON schema dict ({exc})"
        ) from None
