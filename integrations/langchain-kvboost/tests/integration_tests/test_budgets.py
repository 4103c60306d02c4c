"""Forced tool calls and structured outputs on the embedded model at budgets from the minimum
up: every reply parses and validates, and a budget below the minimum is refused naming it.

Budgets are a sample (the minimum, one above, the small budgets that cut calls before, 48 and
256), not every value, to keep the module to a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_kvboost import ChatKVBoost
from pydantic import BaseModel

from kvboost_rag import InvalidInputError
from kvboost_rag.decode.tool_calls import call_format

pytest.importorskip("llguidance", reason="tool calling needs kvboost-rag[constrained]")

pytestmark = pytest.mark.slow

QUESTIONS = (
    "Look up the json module.",
    "Find what the with statement does.",
    "Search for how to sort a list of tuples by the second item.",
    "Which exceptions does int() raise on bad input?",
)


@tool
def lookup(query: str, section: str) -> str:
    """Search the Python documentation.

    Args:
        query: What to search for.
        section: Part of the docs: library, reference or tutorial.
    """
    return f"{section}: {query}"


class Answer(BaseModel):
    """A short answer."""

    topic: str
    answer: str
    confidence: int


def _budgets(minimum: int) -> list[int]:
    return sorted({minimum, minimum + 1, 24, 32, 48, 256} - set(range(minimum)))


def test_forced_calls_parse_at_every_budget_from_the_minimum() -> None:
    engine = ChatKVBoost().engine  # every ChatKVBoost over the default model shares it
    minimum = engine.min_new_tokens(call_format([convert_to_openai_tool(lookup)], "lookup").constraint)
    assert minimum is not None and 24 < minimum < 48  # the 24 is refused, its 48 closes
    with pytest.raises(InvalidInputError, match=rf"max_new_tokens={minimum - 1} is below the {minimum} tokens"):
        ChatKVBoost(max_new_tokens=minimum - 1).bind_tools([lookup], tool_choice="lookup").invoke(QUESTIONS[0])
    for budget in _budgets(minimum):
        model = ChatKVBoost(max_new_tokens=budget).bind_tools([lookup], tool_choice="lookup")
        # The questions decode together (one batch; each reply is still its own greedy output).
        for question, reply in zip(QUESTIONS, model.batch(list(QUESTIONS)), strict=True):
            assert isinstance(reply, AIMessage) and reply.invalid_tool_calls == [], (budget, question)
            [call] = reply.tool_calls
            assert call["name"] == "lookup" and set(call["args"]) == {"query", "section"}
            lookup.invoke(call["args"])
            assert reply.usage_metadata["output_tokens"] <= budget
            assert reply.response_metadata["finish_reason"] == "eos"


def test_structured_outputs_validate_at_every_budget_from_the_minimum() -> None:
    schema = Answer.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    minimum = ChatKVBoost().engine.min_new_tokens(call_format(response_format=response_format).constraint)
    assert minimum is not None and minimum < 24
    with pytest.raises(InvalidInputError, match=rf"max_new_tokens={minimum - 1} is below the {minimum} tokens"):
        ChatKVBoost(max_new_tokens=minimum - 1).with_structured_output(Answer).invoke(QUESTIONS[0])
    for budget in _budgets(minimum):
        model = ChatKVBoost(max_new_tokens=budget).with_structured_output(Answer, include_raw=True)
        for question, out in zip(QUESTIONS[:3], model.batch(list(QUESTIONS[:3])), strict=True):
            assert out["parsing_error"] is None and isinstance(out["parsed"], Answer), (budget, question, out["raw"])
            assert out["raw"].usage_metadata["output_tokens"] <= budget


def test_parallel_calls_parse_with_their_own_ids() -> None:
    model = ChatKVBoost(max_new_tokens=96).bind_tools([lookup], tool_choice="any", parallel_tool_calls=True)
    questions = ("Look up the json module and the csv module.", QUESTIONS[1])
    for question, reply in zip(questions, model.batch(list(questions)), strict=True):
        assert reply.tool_calls and reply.invalid_tool_calls == [], reply.content
        assert len({call["id"] for call in reply.tool_calls}) == len(reply.tool_calls)
        for call in reply.tool_calls:
            lookup.invoke(call["args"])
