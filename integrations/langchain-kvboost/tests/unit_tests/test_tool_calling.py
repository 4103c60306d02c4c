"""ChatKVBoost tool calling and structured output on a tiny random-weight model.

Random weights make no sensible choice, so every check here is about what constrained
decoding guarantees: calls name a bound tool, arguments are valid, outputs parse.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_kvboost import ChatKVBoost
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from kvboost_rag import InvalidInputError
from kvboost_rag.dev.testing import record_calls

pytest.importorskip("llguidance", reason="tool calling needs kvboost-rag[constrained]")

SYSTEM = "You answer questions about the Python language reference."


@tool
def lookup(section: Literal["reference", "library", "tutorial"]) -> str:
    """Look up a section of the Python documentation."""
    return f"the {section} section"


@tool
def add(a: int = Field(ge=0, le=99), b: int = Field(ge=0, le=99)) -> int:
    """Add two small integers."""
    return a + b


@tool
def clock() -> str:
    """The current time."""
    return "noon"


class Answer(BaseModel):
    """An answer with a confidence."""

    kind: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=10)


class AnswerDict(TypedDict):
    """An answer as a dict."""

    kind: Literal["yes", "no"]


ANSWER_SCHEMA = {
    "title": "answer",
    "type": "object",
    "properties": {"kind": {"enum": ["yes", "no"]}},
    "required": ["kind"],
}


@pytest.fixture
def chat(engine: Any) -> ChatKVBoost:
    return ChatKVBoost(engine=engine, max_new_tokens=64, temperature=1.0, seed=3)


def _messages(question: str = "Which section explains the with statement?") -> list[Any]:
    return [SystemMessage(SYSTEM), HumanMessage(question)]


@pytest.mark.parametrize("choice", ["any", "required", True, "lookup", "add", "clock"])
@pytest.mark.parametrize("seed", range(3))
def test_forced_choices_give_valid_calls(chat: ChatKVBoost, choice: Any, seed: int) -> None:
    reply = chat.bind_tools([lookup, add, clock], tool_choice=choice).invoke(_messages(), seed=seed)
    assert reply.content == "" and reply.invalid_tool_calls == []
    [call] = reply.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "tool_call"
    if isinstance(choice, str) and choice not in ("any", "required"):
        assert call["name"] == choice
    tools = {"lookup": lookup, "add": add, "clock": clock}
    tools[call["name"]].invoke(call["args"])  # the arguments validate against the tool's schema


@pytest.mark.parametrize("seed", range(6))
def test_auto_gives_text_or_a_valid_call(chat: ChatKVBoost, seed: int) -> None:
    reply = chat.bind_tools([lookup, add]).invoke(_messages(), seed=seed, max_new_tokens=24)
    if reply.tool_calls:
        assert reply.content == ""
        assert reply.tool_calls[0]["name"] in ("lookup", "add")
    else:
        assert isinstance(reply.content, str) and not reply.content.startswith("<")


@pytest.mark.parametrize("seed", range(4))
def test_none_gives_text_only(chat: ChatKVBoost, seed: int) -> None:
    reply = chat.bind_tools([lookup], tool_choice="none").invoke(_messages(), seed=seed, max_new_tokens=16)
    assert reply.tool_calls == [] and reply.invalid_tool_calls == []
    assert not reply.content.startswith("<")


def test_unknown_tool_choice_names_the_fix(chat: ChatKVBoost) -> None:
    with pytest.raises(InvalidInputError, match=r"not one of the bound tools \['lookup'\]"):
        chat.bind_tools([lookup], tool_choice="multiply")


def test_parallel_tool_calls_parse_with_distinct_ids(chat: ChatKVBoost) -> None:
    model = chat.bind_tools([lookup, add, clock], tool_choice="any", parallel_tool_calls=True)
    counts = []
    for seed in range(6):
        reply = model.invoke(_messages(), seed=seed, max_new_tokens=96)
        assert reply.content == "" and reply.invalid_tool_calls == [] and reply.tool_calls
        assert len({c["id"] for c in reply.tool_calls}) == len(reply.tool_calls)
        tools = {"lookup": lookup, "add": add, "clock": clock}
        for call in reply.tool_calls:
            tools[call["name"]].invoke(call["args"])
        counts.append(len(reply.tool_calls))
    assert max(counts) >= 2, counts
    single = chat.bind_tools([lookup, add, clock], tool_choice="any", parallel_tool_calls=False)
    assert all(len(single.invoke(_messages(), seed=seed).tool_calls) == 1 for seed in range(3))


def test_tool_results_go_back_and_the_tool_prefix_is_reused(chat: ChatKVBoost) -> None:
    model = chat.bind_tools([lookup, add], tool_choice="lookup")
    first = model.invoke(_messages())
    call = first.tool_calls[0]
    history = [*_messages(), first, ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"])]
    prompt = chat.render_prompt(history, tools=[lookup, add])
    assert '"name": "lookup", "arguments": ' + json.dumps(call["args"]) in prompt
    assert f"<tool_response>\n{lookup.invoke(call['args'])}\n</tool_response>" in prompt
    second = model.invoke(history)
    # The system message with the tools' description is the cached beginning of both prompts.
    system_and_tools = chat.render_prompt([SystemMessage(SYSTEM)], tools=[lookup, add]).split("<|im_end|>")[0]
    assert second.usage_metadata["input_token_details"]["cache_read"] >= chat.get_num_tokens(system_and_tools)
    assert second.tool_calls[0]["name"] == "lookup"


def test_stream_sends_a_call_as_tool_call_chunks(chat: ChatKVBoost) -> None:
    model = chat.bind_tools([lookup], tool_choice="any")
    chunks = list(model.stream(_messages()))
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    invoked = model.invoke(_messages())
    assert full.tool_calls[0]["name"] == invoked.tool_calls[0]["name"] == "lookup"
    assert full.tool_calls[0]["args"] == invoked.tool_calls[0]["args"]
    assert full.content == ""
    assert not any(isinstance(c.content, str) and "<tool_call>" in c.content for c in chunks)


async def test_astream_and_ainvoke_make_the_same_call(chat: ChatKVBoost) -> None:
    model = chat.bind_tools([add], tool_choice="add")
    full = None
    async for chunk in model.astream(_messages("1+2?")):
        full = chunk if full is None else full + chunk
    reply = await model.ainvoke(_messages("1+2?"))
    assert full is not None and full.tool_calls[0]["args"] == reply.tool_calls[0]["args"]


def test_a_budget_below_the_shortest_call_is_refused_naming_the_minimum(chat: ChatKVBoost) -> None:
    model = chat.bind_tools([lookup], tool_choice="any")
    with pytest.raises(InvalidInputError, match=r"max_new_tokens=4 is below the \d+ tokens") as refused:
        model.invoke(_messages(), max_new_tokens=4)
    minimum = int(str(refused.value).split("at least ")[1].split()[0])
    reply = model.invoke(_messages(), max_new_tokens=minimum)
    [call] = reply.tool_calls
    lookup.invoke(call["args"])
    assert reply.invalid_tool_calls == [] and reply.response_metadata["finish_reason"] == "eos"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("seed", range(3))
def test_structured_output_pydantic(chat: ChatKVBoost, method: str, seed: int) -> None:
    result = chat.with_structured_output(Answer, method=method).invoke(_messages("Is a tuple immutable?"), seed=seed)
    assert isinstance(result, Answer)


@pytest.mark.parametrize("schema", [AnswerDict, ANSWER_SCHEMA])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_typed_dict_and_json_schema(chat: ChatKVBoost, schema: Any, method: str) -> None:
    result = chat.with_structured_output(schema, method=method).invoke(_messages("Is a tuple immutable?"))
    assert result in ({"kind": "yes"}, {"kind": "no"})


def test_structured_output_include_raw(chat: ChatKVBoost) -> None:
    out = chat.with_structured_output(Answer, include_raw=True).invoke(_messages("Is a tuple immutable?"))
    assert isinstance(out["raw"], AIMessage) and out["parsing_error"] is None
    assert Answer.model_validate_json(out["raw"].content) == out["parsed"]


@pytest.mark.parametrize("seed", range(3))
def test_json_mode_with_a_schema_parses_into_it(chat: ChatKVBoost, seed: int) -> None:
    out = chat.with_structured_output(Answer, method="json_mode", include_raw=True).invoke(
        "Is a tuple immutable? Reply in JSON with 'kind' and 'confidence'.", seed=seed
    )
    assert isinstance(out["parsed"], Answer)


def test_json_mode_output_starts_a_json_object(chat: ChatKVBoost) -> None:
    raw = chat.bind(response_format={"type": "json_object"}).invoke(_messages(), max_new_tokens=8)
    assert raw.content.startswith("{")


def test_structured_output_arguments_are_checked(chat: ChatKVBoost) -> None:
    with pytest.raises(InvalidInputError, match="not one of"):
        chat.with_structured_output(Answer, method="xml")
    with pytest.raises(InvalidInputError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(ValueError, match="unsupported arguments"):
        chat.with_structured_output(Answer, tool_name="x")
    with pytest.raises(InvalidInputError, match="response_format"):
        chat.bind(response_format={"type": "text"}).invoke(_messages())
    with pytest.raises(InvalidInputError, match="invalid JSON schema"):
        chat.with_structured_output({"title": "bad", "type": "objectx"}).invoke(_messages())


def test_token_count_includes_tools(chat: ChatKVBoost) -> None:
    messages = _messages()
    assert chat.get_num_tokens_from_messages(messages, tools=[lookup]) > chat.get_num_tokens_from_messages(messages)


def test_template_that_renders_tools_gets_them_as_tools(engine: Any) -> None:
    engine.tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS {{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
    )
    engine._chat._renders_tools = None
    chat = ChatKVBoost(engine=engine, max_new_tokens=48)
    call = {"name": "lookup", "args": {"section": "library"}, "id": "call_1", "type": "tool_call"}
    history = [*_messages(), AIMessage("", tool_calls=[call]), ToolMessage("found", tool_call_id="call_1")]
    prompt = chat.render_prompt(history, tools=[lookup, add])
    assert prompt.startswith("<|im_start|>system\nTOOLS lookup,add<|im_end|>")
    assert "# Tools" not in prompt and "CALL lookup" in prompt and "<|im_start|>tool\nfound" in prompt


def test_repetition_penalty_reaches_the_engine(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, engine, "generate")
    chat = ChatKVBoost(engine=engine, max_new_tokens=4, repetition_penalty=1.2)
    chat.invoke(_messages())
    chat.invoke(_messages(), repetition_penalty=1.5)
    assert [call["repetition_penalty"] for call in calls] == [1.2, 1.5]
    with pytest.raises(ValueError, match="repetition_penalty"):
        ChatKVBoost(engine=engine, repetition_penalty=0.5)


def test_documents_in_a_tool_result_are_read_from_cache(chat: ChatKVBoost, engine: Any) -> None:
    from kvboost_rag.corpus import python_reference_documents

    documents = python_reference_documents(max_chars=300)[:2]
    engine.warm_documents(documents)

    @tool
    def search(section: Literal["reference"]) -> str:
        """Search the documentation."""
        return "\n\n".join(documents)

    model = chat.bind_tools([search], tool_choice="search")
    first = model.invoke(_messages())
    call = first.tool_calls[0]
    reply = model.invoke([*_messages(), first, ToolMessage(search.invoke(call["args"]), tool_call_id=call["id"])])
    assert reply.response_metadata["documents_found"] == 2
    assert reply.response_metadata["content_hit_tokens"] > 0
    assert reply.tool_calls[0]["name"] == "search"
