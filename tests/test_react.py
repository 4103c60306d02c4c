"""The ReAct text format: tools read from the prompt, steps that parse from random weights."""

from __future__ import annotations

import json
import re

import pytest

from kvboost_rag import InvalidInputError
from kvboost_rag.decode.react import (
    ACTION,
    ANSWER,
    ANY_STEP,
    observations_since_question,
    react_call_format,
    react_constraint,
    react_tools,
)

pytest.importorskip("llguidance", reason="constrained decoding is the optional extra kvboost-rag[constrained]")

LOOKUP_ARGS = {
    "type": "object",
    "properties": {"section": {"enum": ["reference", "library"]}, "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["section"],
}

#: The tools part and output format line of LlamaIndex's ReAct system header, as its
#: ReActChatFormatter writes them (a multi-line description included).
SYSTEM = f"""You are designed to help with a variety of tasks.

## Tools

You have access to the following tools:
> Tool Name: lookup
Tool Description: Look up a section.
It spans two lines.
Tool Args: {json.dumps(LOOKUP_ARGS)}

> Tool Name: clock
Tool Description: The time.
Tool Args: {{"properties": {{}}, "type": "object"}}


## Output Format

```
Thought: The current language of the user is: (user's language). I need to use a tool to help me answer the question.
Action: tool name (one of lookup, clock) if using a tool.
Action Input: the input to the tool, in a JSON format representing the kwargs (e.g. {{"input": "hello world", "num_beams": 5}})
```
"""

#: What LlamaIndex's ReActOutputParser reads (its patterns, simplified).
ACTION_PATTERN = re.compile(r"^Thought: [^\n]+\nAction: (\w+)\nAction Input: (\{.*\})$", re.S)
ANSWER_PATTERN = re.compile(r"^Thought: [^\n]+\nAnswer: \S", re.S)


@pytest.fixture
def engine(make_engine):
    return make_engine("llama")


def test_tools_are_read_from_the_system_header():
    lookup, clock = react_tools(SYSTEM)
    assert (lookup.name, lookup.parameters) == ("lookup", LOOKUP_ARGS)
    assert (clock.name, clock.parameters) == ("clock", {"properties": {}, "type": "object"})
    assert react_tools("You are a helpful assistant.") is None
    assert react_call_format("You are a helpful assistant.") is None


def test_a_tool_without_a_schema_takes_any_object_and_an_undescribed_one_is_left_out():
    text = SYSTEM.replace(json.dumps(LOOKUP_ARGS), "not json").replace("lookup, clock", "lookup, clock, ghost")
    assert [(s.name, s.parameters) for s in react_tools(text)] == [("lookup", {"type": "object"}), ("clock", {"properties": {}, "type": "object"})]


def test_observations_are_counted_from_the_last_question():
    question = ("user", "What does with do?")
    step = ("assistant", "Thought: search.\nAction: lookup\nAction Input: {}")
    seen = ("user", "Observation: the with statement ...")
    assert observations_since_question([question]) == 0
    assert observations_since_question([question, step, seen]) == 1
    assert observations_since_question([question, step, seen, step, seen, ("user", "And for?")]) == 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("step", [ANY_STEP, ACTION, ANSWER])
def test_steps_from_random_weights_parse_at_every_budget_from_the_minimum(engine, seed, step):
    constraint = react_constraint(react_tools(SYSTEM), step)
    minimum = engine.min_new_tokens(constraint)
    assert minimum is not None
    with pytest.raises(InvalidInputError, match=f"at least {minimum}"):
        engine.generate("Act.", max_new_tokens=minimum - 1, constraint=constraint)
    for budget in sorted({minimum, minimum + 1, 24, 64} - set(range(minimum))):
        result = engine.generate("Act.", max_new_tokens=budget, temperature=1.0, seed=seed, constraint=constraint)
        text = result.output_text
        assert result.generated_tokens <= budget
        action = ACTION_PATTERN.match(text)
        if action:
            assert step != ANSWER and result.finish_reason == "eos", text
            arguments = json.loads(action.group(2))
            if action.group(1) == "lookup":
                assert arguments["section"] in ("reference", "library") and set(arguments) <= {"section", "limit"}
            else:
                assert action.group(1) == "clock" and arguments == {}
        else:
            assert step != ACTION and ANSWER_PATTERN.match(text), text


def test_tool_steps_act_first_then_answer():
    question = [("user", "What does with do?")]
    after = [*question, ("assistant", "Thought: search.\nAction: clock\nAction Input: {}"), ("user", "Observation: noon")]
    assert react_call_format(SYSTEM, question).constraint == react_constraint(react_tools(SYSTEM), ANY_STEP)
    assert react_call_format(SYSTEM, question, tool_steps=1).constraint == react_constraint(react_tools(SYSTEM), ACTION)
    assert react_call_format(SYSTEM, after, tool_steps=1).constraint == react_constraint(react_tools(SYSTEM), ANSWER)
    assert react_call_format(SYSTEM, after, tool_steps=2).constraint == react_constraint(react_tools(SYSTEM), ACTION)
    assert react_call_format(SYSTEM, question, tool_steps=1).specs == ()  # the agent parses the text


def test_a_constraint_needs_tools_and_a_known_step():
    with pytest.raises(InvalidInputError, match="at least one tool"):
        react_constraint([])
    with pytest.raises(InvalidInputError, match="step must be"):
        react_constraint(react_tools(SYSTEM), "think")
