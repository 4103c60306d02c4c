"""Tool calls: choices, constraints that give valid calls from random weights, rendering, parsing."""

from __future__ import annotations

import json

import pytest

from kvboost_rag import InvalidInputError
from kvboost_rag.decode import tool_calls
from kvboost_rag.decode.tool_calls import (
    AUTO,
    NONE,
    REQUIRED,
    CallFormat,
    call_format,
    call_text,
    closed_schema,
    fallback_messages,
    normalize_tool_choice,
    parse_tool_calls,
    tool_choice_constraint,
    tool_specs,
    with_system_text,
)
from kvboost_rag.log_limits import RateLimitedLogger

pytest.importorskip("llguidance", reason="constrained decoding is the optional extra kvboost-rag[constrained]")

# Bounded integers: random weights would otherwise write digits until the budget ends.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 999},
                    "b": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a section up.",
            "parameters": {
                "type": "object",
                "properties": {"kind": {"$ref": "#/$defs/Kind"}},
                "required": ["kind"],
                "$defs": {"Kind": {"enum": ["reference", "library"]}},
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture
def engine(make_engine):
    return make_engine("llama")


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, AUTO),
        ("auto", AUTO),
        ("any", REQUIRED),
        ("required", REQUIRED),
        (True, REQUIRED),
        ("none", NONE),
        ("add", "add"),
        ({"type": "function", "function": {"name": "now"}}, "now"),
    ],
)
def test_tool_choice_forms(choice, expected):
    assert normalize_tool_choice(choice, ["add", "lookup", "now"]) == expected


def test_unknown_tool_choice_names_the_tools():
    with pytest.raises(InvalidInputError, match=r"not one of the bound tools \['add', 'now'\]"):
        normalize_tool_choice("multiply", ["add", "now"])


def test_duplicate_names_keep_the_last_definition(caplog, monkeypatch):
    monkeypatch.setattr(tool_calls, "_warnings", RateLimitedLogger(tool_calls.logger))
    renamed = {"type": "function", "function": {**TOOLS[2]["function"], "name": "add"}}
    assert [s.name for s in tool_specs([TOOLS[0], TOOLS[1], TOOLS[0]])] == ["lookup", "add"]
    assert "different tools" not in caplog.text
    [spec] = tool_specs([TOOLS[0], renamed])
    assert spec.description == "The time."
    assert "two different tools are named 'add'" in caplog.text


def test_malformed_tools_are_rejected():
    with pytest.raises(InvalidInputError, match="'name'"):
        tool_specs([{"type": "function", "function": {"description": "x"}}])
    with pytest.raises(InvalidInputError, match="object schema"):
        tool_specs([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])


@pytest.mark.parametrize("choice", [REQUIRED, "add", "lookup", "now"])
@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_choices_give_valid_calls_from_random_weights(engine, choice, seed):
    specs = tool_specs(TOOLS)
    result = engine.generate(
        "Call a tool.", max_new_tokens=64, temperature=1.0, seed=seed, constraint=tool_choice_constraint(specs, choice)
    )
    assert result.finish_reason == "eos", result.output_text
    parsed = parse_tool_calls(result.output_text, result.finish_reason)
    assert parsed.content == "" and not parsed.invalid_calls
    [call] = parsed.calls
    if choice != REQUIRED:
        assert call.name == choice
    if call.name == "add":
        assert set(call.arguments) == {"a", "b"} and all(isinstance(v, int) for v in call.arguments.values())
    elif call.name == "lookup":
        assert call.arguments in ({"kind": "reference"}, {"kind": "library"})
    else:
        assert call.name == "now" and call.arguments == {}


@pytest.mark.parametrize("choice", [AUTO, NONE])
@pytest.mark.parametrize("seed", range(4))
def test_auto_and_none_give_text_or_a_valid_call(engine, choice, seed):
    specs = tool_specs(TOOLS)
    result = engine.generate(
        "Hello.", max_new_tokens=32, temperature=1.0, seed=seed, constraint=tool_choice_constraint(specs, choice)
    )
    parsed = parse_tool_calls(result.output_text, result.finish_reason)
    if result.output_text.startswith("<"):
        assert choice == AUTO
        assert len(parsed.valid_calls) == 1
    else:
        assert parsed.calls == [] and parsed.content == result.output_text
        assert not result.output_text[:1].isspace()


def test_auto_constraint_lets_a_call_through(engine):
    # Force the model's hand through the grammar: the call text itself is in the language.
    specs = tool_specs(TOOLS)
    constraint = tool_choice_constraint(specs, AUTO)
    guide = engine._constraints.compile(constraint)
    for token in engine.token_ids(call_text("add", {"a": 1, "b": 2})):
        guide.advance(token)
    assert guide.complete


def test_required_choice_without_tools_is_an_error():
    with pytest.raises(InvalidInputError, match="at least one bound tool"):
        tool_choice_constraint([], REQUIRED)


def test_closed_schema_closes_nested_objects_only_where_unspecified():
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "$defs": {"Open": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["$defs"]["Open"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the input is left alone


def test_parse_text_calls_and_cut_calls():
    text = "Let me look.\n" + call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("now", {})
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.valid_calls] == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert len({c.id for c in parsed.calls}) == 2 and all(c.id.startswith("call_") for c in parsed.calls)
    cut = parse_tool_calls('<tool_call>\n{"name": "add", "argu', "length")
    [call] = cut.invalid_calls
    assert "max_new_tokens" in call.error and call.raw == '{"name": "add", "argu'
    assert parse_tool_calls("plain answer").calls == []
    [opening_cut] = parse_tool_calls("<tool_", "length").invalid_calls
    assert "max_new_tokens" in opening_cut.error


def test_fallback_messages_describe_tools_and_write_history_as_text():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    out = fallback_messages(messages, tool_specs(TOOLS))
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps({"name": "now", "description": "The time.", "parameters": {"type": "object", "properties": {}}}) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("add", {"a": 1, "b": 2})}
    assert out[3] == {"role": "tool", "content": "<tool_response>\n3\n</tool_response>"}
    assert fallback_messages(messages[1:2], tool_specs(TOOLS))[0]["role"] == "system"


def test_template_tool_rendering_is_detected(engine):
    assert engine.chat_template_renders_tools is False
    engine.tokenizer.chat_template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    engine._chat._renders_tools = None
    assert engine.chat_template_renders_tools is True


def test_response_formats_constrain_and_instruct():
    schema = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]}
    structured = call_format(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert structured.constraint.json_schema == {**schema, "additionalProperties": False}
    assert structured.instructions.endswith(json.dumps(structured.constraint.json_schema))
    json_mode = call_format(response_format={"type": "json_object"})
    assert json_mode.constraint.json_schema == {"type": "object"}
    assert json_mode.instructions == "Reply with only a JSON object."
    json_mode_schema = call_format(response_format={"type": "json_object", "schema": schema})
    assert json_mode_schema.constraint == structured.constraint
    assert json_mode_schema.instructions == "Reply with only a JSON object."
    with pytest.raises(InvalidInputError, match="response_format"):
        call_format(response_format={"type": "text"})
    assert call_format() == CallFormat()
    messages = [{"role": "user", "content": "hi"}]
    assert with_system_text(messages, "Be JSON.") == [{"role": "system", "content": "Be JSON."}, *messages]
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert with_system_text(system, "Be JSON.")[0] == {"role": "system", "content": "Be brief.\n\nBe JSON."}
    assert system[0]["content"] == "Be brief."  # the input is left alone


#: Free strings and an unbounded integer: random weights fill them until the budget ends
#: unless decoding closes the call in time.
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the docs.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "section": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query", "section", "limit"],
        },
    },
}

#: Nested objects and arrays, an optional key, a boolean: closing must end every level.
REPORT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "source": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "pages": {"type": "array", "items": {"type": "integer"}}},
            "required": ["name", "pages"],
        },
        "draft": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["title", "tags", "source", "draft"],
}


def _minimum(engine, constraint) -> int:
    """The engine's minimum budget, checked against the one the refusal of a smaller budget names."""
    minimum = engine.min_new_tokens(constraint)
    with pytest.raises(InvalidInputError, match=rf"max_new_tokens={minimum - 1} is below the {minimum} tokens"):
        engine.stream("Hello.", max_new_tokens=minimum - 1, constraint=constraint)
    return minimum


def _budgets(minimum: int) -> list[int]:
    return sorted({minimum, minimum + 1, minimum + 2, 24, 32, 48, 96, 256} - set(range(minimum)))


@pytest.mark.parametrize("seed", range(3))
def test_forced_calls_from_random_weights_close_at_every_budget_from_the_minimum(engine, seed):
    constraint = tool_choice_constraint(tool_specs([SEARCH]), "search")
    minimum = _minimum(engine, constraint)
    for budget in _budgets(minimum):
        result = engine.generate("Search.", max_new_tokens=budget, temperature=1.0, seed=seed, constraint=constraint)
        assert result.finish_reason == "eos", (budget, result.output_text)
        assert result.generated_tokens <= budget
        [call] = parse_tool_calls(result.output_text, result.finish_reason).valid_calls
        assert call.name == "search" and set(call.arguments) == {"query", "section", "limit"}
        assert isinstance(call.arguments["limit"], int)


@pytest.mark.parametrize("seed", range(3))
def test_structured_outputs_from_random_weights_close_at_every_budget_from_the_minimum(engine, seed):
    constraint = call_format(response_format={"type": "json_schema", "json_schema": {"schema": REPORT_SCHEMA}}).constraint
    minimum = _minimum(engine, constraint)
    for budget in _budgets(minimum):
        result = engine.generate("Report.", max_new_tokens=budget, temperature=1.0, seed=seed, constraint=constraint)
        assert result.finish_reason == "eos", (budget, result.output_text)
        assert result.generated_tokens <= budget
        report = json.loads(result.output_text)
        assert set(report) - {"note"} == {"title", "tags", "source", "draft"}
        assert isinstance(report["draft"], bool) and all(isinstance(p, int) for p in report["source"]["pages"])


def test_a_batch_below_the_minimum_fails_before_any_prefill(engine):
    constraint = tool_choice_constraint(tool_specs([SEARCH]), "search")
    with pytest.raises(InvalidInputError, match="raise max_new_tokens to at least"):
        engine.generate_batch(["Search.", "Again."], max_new_tokens=4, constraint=constraint)
    assert engine._places.admitted == 0


def test_parallel_choice_takes_several_calls_and_single_takes_one(engine):
    specs = tool_specs(TOOLS)
    two = call_text("add", {"a": 1, "b": 2}) + "\n" + call_text("now", {})
    parallel = engine._constraints.compile(tool_choice_constraint(specs, REQUIRED, parallel=True))
    for token in engine.token_ids(two):
        assert parallel.advance(token)
    assert parallel.complete
    single = engine._constraints.compile(tool_choice_constraint(specs, REQUIRED))
    with pytest.raises(RuntimeError, match="constrained decoding failed"):
        for token in engine.token_ids(two):
            single.advance(token)


def test_parallel_calls_from_random_weights_parse_with_distinct_ids(engine):
    constraint = tool_choice_constraint(tool_specs(TOOLS), REQUIRED, parallel=True)
    counts = []
    for seed in range(8):
        result = engine.generate("Call tools.", max_new_tokens=96, temperature=1.0, seed=seed, constraint=constraint)
        parsed = parse_tool_calls(result.output_text, result.finish_reason)
        assert result.finish_reason == "eos" and parsed.content == "" and not parsed.invalid_calls, result.output_text
        assert len({c.id for c in parsed.calls}) == len(parsed.calls) >= 1
        counts.append(len(parsed.calls))
    assert max(counts) >= 2, counts
