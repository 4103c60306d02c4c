"""KVBoostLLM as a FunctionCallingLLM and structured predictor, on a tiny random-weight model.

Random weights make no sensible choice, so these tests check what constrained decoding
guarantees: calls name a given tool with valid arguments, structured outputs validate.
"""


import asyncio
from typing import Any, Literal

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.agent.react.formatter import ReActChatFormatter
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import Document
from llama_index.core.tools import FunctionTool, QueryEngineTool, ToolMetadata
from llama_index.llms.kvboost import KVBoostLLM
from pydantic import BaseModel, Field

from kvboost_rag import InvalidInputError, KVBoost
from kvboost_rag.decode.tool_calls import call_text
from kvboost_rag.dev.testing import record_calls

pytest.importorskip("llguidance", reason="function calling needs kvboost-rag[constrained]")


class Answer(BaseModel):
    """An answer with a confidence."""

    kind: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=10)


class ShortQuery(BaseModel):
    """A query-engine tool's input, bounded."""

    input: str = Field(max_length=24)


@pytest.fixture
def calls() -> list[str]:
    return []


@pytest.fixture
def lookup(calls: list[str]) -> FunctionTool:
    def lookup(section: Literal["reference", "library", "tutorial"]) -> str:
        """Look up a section of the Python documentation."""
        calls.append(section)
        return f"The {section} section explains the with statement."

    return FunctionTool.from_defaults(fn=lookup)


@pytest.fixture
def add() -> FunctionTool:
    def add(a: int = Field(ge=0, le=99), b: int = Field(ge=0, le=99)) -> int:
        """Add two small integers."""
        return a + b

    return FunctionTool.from_defaults(fn=add)


@pytest.fixture
def llm(tiny_engine: KVBoost) -> KVBoostLLM:
    return KVBoostLLM(engine=tiny_engine, max_new_tokens=64, temperature=1.0, seed=5)


@pytest.mark.parametrize("seed", range(3))
def test_tool_required_gives_a_valid_call(llm: KVBoostLLM, lookup: FunctionTool, add: FunctionTool, seed: int) -> None:
    response = llm.chat_with_tools([lookup, add], user_msg="Which section explains with?", tool_required=True, seed=seed)
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_id.startswith("call_")
    tool = {"lookup": lookup, "add": add}[selection.tool_name]
    tool.fn(**selection.tool_kwargs)  # the arguments fit the function's signature and types
    assert response.message.content == ""


def test_tool_choice_by_name(llm: KVBoostLLM, lookup: FunctionTool, add: FunctionTool) -> None:
    response = llm.chat_with_tools([lookup, add], user_msg="1+2?", tool_choice="add")
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "add"
    assert set(selection.tool_kwargs) == {"a", "b"}
    with pytest.raises(InvalidInputError, match=r"not one of the bound tools \['lookup', 'add'\]"):
        llm.chat_with_tools([lookup, add], user_msg="1+2?", tool_choice="multiply")


@pytest.mark.parametrize("seed", range(4))
def test_without_tool_required_the_reply_is_text_or_a_call(llm: KVBoostLLM, lookup: FunctionTool, seed: int) -> None:
    response = llm.chat_with_tools([lookup], user_msg="Hello.", seed=seed, max_new_tokens=24)
    selections = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
    if selections:
        assert selections[0].tool_name == "lookup" and response.message.content == ""
    else:
        assert not response.message.content.startswith("<")
        with pytest.raises(ValueError, match="expected at least one tool call"):
            llm.get_tool_calls_from_response(response)


def test_a_budget_below_the_shortest_call_is_refused_naming_the_minimum(llm: KVBoostLLM, lookup: FunctionTool) -> None:
    with pytest.raises(InvalidInputError, match=r"max_new_tokens=5 is below the \d+ tokens") as refused:
        llm.chat_with_tools([lookup], user_msg="find", tool_required=True, max_new_tokens=5)
    minimum = int(str(refused.value).split("at least ")[1].split()[0])
    response = llm.chat_with_tools([lookup], user_msg="find", tool_required=True, max_new_tokens=minimum)
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "lookup" and selection.tool_kwargs["section"] in ("reference", "library", "tutorial")


def test_parallel_tool_calls_parse_with_distinct_ids(
    llm: KVBoostLLM, lookup: FunctionTool, add: FunctionTool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's tests show the grammar yields several calls; these random weights end after
    # the first, so the reply is replaced by two calls, and the grammar is checked to hold them.
    two = call_text("lookup", {"section": "library"}) + "\n" + call_text("add", {"a": 1, "b": 2})
    constraints = []
    real = llm.engine.generate

    def generate(prompt: str, **params: Any) -> Any:
        constraints.append(params["constraint"])
        return real(prompt, **params).model_copy(update={"output_text": two})

    monkeypatch.setattr(llm.engine, "generate", generate)
    response = llm.chat_with_tools([lookup, add], user_msg="find", tool_required=True, allow_parallel_tool_calls=True)
    selections = llm.get_tool_calls_from_response(response)
    assert [(s.tool_name, s.tool_kwargs) for s in selections] == [("lookup", {"section": "library"}), ("add", {"a": 1, "b": 2})]
    assert len({s.tool_id for s in selections}) == 2
    guide = llm.engine._constraints.compile(constraints[0])
    assert all(guide.advance(token) for token in llm.engine.token_ids(two)) and guide.complete
    llm.chat_with_tools([lookup, add], user_msg="find", tool_required=True)
    single = llm.engine._constraints.compile(constraints[1])
    with pytest.raises(RuntimeError, match="constrained decoding failed"):
        for token in llm.engine.token_ids(two):
            single.advance(token)


def test_predict_and_call_runs_the_tool(llm: KVBoostLLM, lookup: FunctionTool, calls: list[str]) -> None:
    output = llm.predict_and_call([lookup], "Which section explains with?", tool_required=True)
    assert calls and output.response == f"The {calls[0]} section explains the with statement."


def test_stream_chat_with_tools_ends_with_the_call(llm: KVBoostLLM, lookup: FunctionTool) -> None:
    responses = list(llm.stream_chat_with_tools([lookup], user_msg="find", tool_required=True))
    assert all("<tool_call>" not in (r.message.content or "") for r in responses)
    [streamed] = llm.get_tool_calls_from_response(responses[-1])
    [invoked] = llm.get_tool_calls_from_response(llm.chat_with_tools([lookup], user_msg="find", tool_required=True))
    assert (streamed.tool_name, streamed.tool_kwargs) == (invoked.tool_name, invoked.tool_kwargs)
    assert responses[-1].raw["usage"]["completion_tokens"] > 0


def test_tool_history_is_rendered_and_the_tools_prefix_reused(llm: KVBoostLLM, lookup: FunctionTool) -> None:
    system = ChatMessage(role=MessageRole.SYSTEM, content="You answer questions about Python.")
    first = llm.chat_with_tools([lookup], user_msg="find", chat_history=[system], tool_required=True)
    [selection] = llm.get_tool_calls_from_response(first)
    result = ChatMessage(role="tool", content="found it", additional_kwargs={"tool_call_id": selection.tool_id})
    history = [system, ChatMessage(role=MessageRole.USER, content="find"), first.message, result]
    second = llm.chat_with_tools([lookup], chat_history=history)
    prompt = llm.messages_to_prompt(history)
    assert '{"name": "lookup", "arguments": {"section": "' in prompt
    assert "<tool_response>\nfound it\n</tool_response>" in prompt
    assert second.raw["prefix_hit_tokens"] > llm.engine.count_tokens("You answer questions about Python.")


def test_tool_call_blocks_render_like_additional_kwargs(llm: KVBoostLLM) -> None:
    block = ChatMessage(
        role=MessageRole.ASSISTANT, blocks=[ToolCallBlock(tool_call_id="c1", tool_name="lookup", tool_kwargs={"section": "library"})]
    )
    kwargs = ChatMessage(
        role=MessageRole.ASSISTANT,
        content="",
        additional_kwargs={"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"section": "library"}}}]},
    )
    user = ChatMessage(role=MessageRole.USER, content="find")
    assert llm.messages_to_prompt([user, block]) == llm.messages_to_prompt([user, kwargs])


@pytest.mark.parametrize("seed", range(3))
def test_structured_predict_gives_a_valid_instance(llm: KVBoostLLM, seed: int) -> None:
    result = llm.structured_predict(Answer, PromptTemplate("Is a {kind} immutable?"), llm_kwargs={"seed": seed}, kind="tuple")
    assert isinstance(result, Answer)


def test_astructured_predict_and_structured_llm(llm: KVBoostLLM) -> None:
    prompt = PromptTemplate("Is a {kind} immutable?")
    result = asyncio.run(llm.astructured_predict(Answer, prompt, kind="tuple"))
    assert isinstance(result, Answer)
    structured = llm.as_structured_llm(Answer)
    response = structured.chat([ChatMessage(role=MessageRole.USER, content="Is a tuple immutable?")])
    assert isinstance(response.raw, Answer)
    assert Answer.model_validate_json(response.message.content) == response.raw


def test_structured_predict_below_the_minimum_budget_says_so(llm: KVBoostLLM) -> None:
    with pytest.raises(InvalidInputError, match="raise max_new_tokens to at least"):
        llm.structured_predict(Answer, PromptTemplate("Is a tuple immutable?"), llm_kwargs={"max_new_tokens": 3})


def test_function_agent_calls_the_tool_then_answers(llm: KVBoostLLM, lookup: FunctionTool, calls: list[str]) -> None:
    agent = FunctionAgent(tools=[lookup], llm=llm, initial_tool_choice="lookup", system_prompt="Use the tools.")

    async def run() -> Any:
        return await agent.run("Which section explains the with statement?")

    answer = asyncio.run(run())
    assert len(calls) >= 1
    assert answer.tool_calls and answer.tool_calls[0].tool_name == "lookup"
    assert isinstance(str(answer), str)


def test_query_engine_tool_over_an_index(llm: KVBoostLLM, hash_embedding: Any) -> None:
    documents = [Document(text="The with statement wraps a block with a context manager."), Document(text="A tuple is immutable.")]
    index = VectorStoreIndex.from_documents(documents, embed_model=hash_embedding)
    # A bounded query string: random weights would otherwise write until the budget ends.
    metadata = ToolMetadata(name="python_docs", description="Python documentation.", fn_schema=ShortQuery)
    tool = QueryEngineTool(index.as_query_engine(llm=llm, similarity_top_k=1), metadata)
    output = llm.predict_and_call([tool], "What does the with statement do?", tool_required=True)
    assert output.sources and output.sources[0].tool_name == "python_docs"
    assert output.sources[0].raw_input["input"]


def test_custom_messages_to_prompt_cannot_show_tools(tiny_engine: KVBoost, lookup: FunctionTool) -> None:
    llm = KVBoostLLM(engine=tiny_engine, messages_to_prompt=lambda messages: "\n".join(m.content for m in messages))
    with pytest.raises(InvalidInputError, match="custom messages_to_prompt"):
        llm.chat_with_tools([lookup], user_msg="find")


def test_repetition_penalty_is_a_field_and_a_call_keyword(tiny_engine: KVBoost, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, tiny_engine, "generate")
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4, repetition_penalty=1.2)
    llm.complete("Hello")
    llm.complete("Hello", repetition_penalty=1.4)
    assert [call["repetition_penalty"] for call in calls] == [1.2, 1.4]


def test_stream_structured_predict_ends_with_a_valid_instance(llm: KVBoostLLM) -> None:
    prompt = PromptTemplate("Is a {kind} immutable?")
    parts = list(llm.stream_structured_predict(Answer, prompt, kind="tuple"))
    assert isinstance(parts[-1], Answer)
    assert len(parts) > 1 and all(not isinstance(p, Answer) for p in parts[:-1])
    assert parts[-2].model_dump() == parts[-1].model_dump()  # the last partial holds every field

    async def collect() -> list[Any]:
        return [p async for p in await llm.astream_structured_predict(Answer, prompt, kind="tuple")]

    assert isinstance(asyncio.run(collect())[-1], Answer)


def test_react_agent_acts_then_answers_in_its_format(tiny_engine: KVBoost, lookup: FunctionTool, calls: list[str]) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=48, temperature=1.0, seed=3, react_tool_steps=1)
    agent = ReActAgent(tools=[lookup], llm=llm)

    async def run() -> Any:
        return await agent.run("Which section explains the with statement?", max_iterations=3)

    answer = asyncio.run(run())
    assert calls and calls[0] in ("reference", "library", "tutorial")  # the action's input fit the tool
    assert [c.tool_name for c in answer.tool_calls] == ["lookup"]
    assert isinstance(str(answer), str)


@pytest.mark.parametrize("react_grammar", [True, False])
def test_react_prompts_are_constrained_unless_turned_off(
    tiny_engine: KVBoost, lookup: FunctionTool, monkeypatch: pytest.MonkeyPatch, react_grammar: bool
) -> None:
    constraints: list[Any] = []
    real = tiny_engine.generate

    def generate(prompt: str, **params: Any) -> Any:
        constraints.append(params.get("constraint"))
        return real(prompt, **params)

    monkeypatch.setattr(tiny_engine, "generate", generate)
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=48, react_grammar=react_grammar)
    messages = ReActChatFormatter.from_defaults().format([lookup], [ChatMessage(role=MessageRole.USER, content="Hi")])
    llm.chat(messages)
    llm.chat([ChatMessage(role=MessageRole.SYSTEM, content="Be brief."), ChatMessage(role=MessageRole.USER, content="Hi")])
    assert constraints[1] is None
    if react_grammar:
        assert constraints[0] is not None and '"lookup\\nAction Input: "' in constraints[0].grammar
    else:
        assert constraints[0] is None
