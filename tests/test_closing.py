"""Closing paths: the shortest way the planner finds to finish a constrained output."""

from __future__ import annotations

import pytest

from kvboost_rag.decode.constrained import ConstraintCompiler, OutputConstraint

pytest.importorskip("llguidance", reason="constrained decoding is the optional extra kvboost-rag[constrained]")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id or 0])


def _closing_text(compiler, tokenizer, constraint, written: str = "") -> str:
    guide = compiler.compile(constraint, budget=10_000)
    for token in tokenizer(written, add_special_tokens=False)["input_ids"]:
        assert guide.advance(token)
    return tokenizer.decode(guide._path)


@pytest.mark.parametrize(
    ("schema", "written", "closing"),
    [
        ({"type": "object"}, "", "{}"),
        ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}, "", '{"a": 0}'),
        ({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}, '{"q": "some', '"}'),
        (
            {"type": "object", "properties": {"x": {"type": "array", "items": {"type": "object"}}}, "required": ["x"]},
            '{"x": [{}, {',
            "}]}",
        ),
        ({"type": "object", "properties": {"b": {"type": "boolean"}, "n": {"type": "null"}}, "required": ["b", "n"]}, "", '{"b": true, "n": null}'),
        ({"type": "object", "properties": {"s": {"type": "string", "minLength": 3}}, "required": ["s"]}, "", '{"s": "}}}"}'),
        ({"type": "object", "properties": {"e": {"type": "string", "pattern": "^[a-z]+@[a-z]+$"}}, "required": ["e"]}, "", '{"e": "a@a"}'),
    ],
)
def test_closing_paths_finish_the_output_shortly(compiler, tokenizer, schema, written, closing):
    constraint = OutputConstraint(json_schema={**schema, "x-guidance": {"whitespace_flexible": False}})
    assert _closing_text(compiler, tokenizer, constraint, written) == closing


def test_a_free_line_is_closed_by_its_newline(compiler, tokenizer):
    # In free text '"' is one more character: the newline that ends the line comes first.
    constraint = OutputConstraint(grammar='start: "Thought: " LINE "\\n" "Done."\nLINE: /[^\\s][^\\n]*/')
    assert _closing_text(compiler, tokenizer, constraint, 'Thought: I think "so') == "\nDone."


def test_a_grammar_path_ends_where_the_grammar_may_end(compiler, tokenizer):
    constraint = OutputConstraint(grammar='start: "yes" | "no" | "maybe later"')
    assert _closing_text(compiler, tokenizer, constraint) in ("yes", "no")
    assert _closing_text(compiler, tokenizer, constraint, "maybe") == " later"


def test_minimum_tokens_is_the_first_paths_length(compiler, tokenizer):
    guide = compiler.compile(OutputConstraint(json_schema={"type": "object"}), budget=5)
    assert guide.minimum_tokens == len(tokenizer("{}", add_special_tokens=False)["input_ids"])
    assert compiler.compile(OutputConstraint(json_schema={"type": "object"})).minimum_tokens is None
    assert compiler.minimum_tokens(OutputConstraint(json_schema={"type": "object"})) == guide.minimum_tokens
