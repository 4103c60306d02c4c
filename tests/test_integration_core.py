"""The framework-free core of both integrations (kvboost_rag.integration)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kvboost_rag import InvalidInputError, PromptTooLongError
from kvboost_rag.decode.tool_calls import CallFormat, call_format
from kvboost_rag.dev.testing import refuse_documents
from kvboost_rag.integration import (
    CALL_PARAMETERS,
    ToolCallHoldBack,
    UnknownParameterError,
    call_params,
    default_max_document_tokens,
    pop_call_format,
    prewarm_texts,
    resolve_aliases,
    result_figures,
    texts_to_warm,
    usage,
)
from kvboost_rag.integration.params import DocumentConverter, document_texts
from kvboost_rag.integration.prewarm import check_max_document_tokens
from kvboost_rag.results import GenerationResult

DEFAULTS = SimpleNamespace(
    max_new_tokens=64, temperature=0.0, top_p=1.0, repetition_penalty=1.0, seed=None, stop=["\n\n"], reuse=True
)

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a section up.",
        "parameters": {"type": "object", "properties": {"section": {"type": "string"}}, "required": ["section"]},
    },
}


class Doc:
    """A framework document object, as a converter sees it."""

    def __init__(self, text: str) -> None:
        self.text = text


DOCS = DocumentConverter(lambda item: item.text if isinstance(item, Doc) else None, "str or Doc")


# -- per-call parameters ------------------------------------------------------------------


def test_call_params_fill_defaults_and_resolve_aliases() -> None:
    params = call_params(DEFAULTS, {}, owner="LLM")
    assert params == {
        "max_new_tokens": 64,
        "temperature": 0.0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "seed": None,
        "stop": ["\n\n"],
        "reuse": True,
        "documents": None,
    }
    assert call_params(DEFAULTS, {"max_tokens": 5}, owner="LLM")["max_new_tokens"] == 5
    assert call_params(DEFAULTS, {"max_new_tokens": 5, "max_tokens": 5}, owner="LLM")["max_new_tokens"] == 5
    with pytest.raises(InvalidInputError, match="max_tokens=3 and max_new_tokens=5 conflict"):
        call_params(DEFAULTS, {"max_new_tokens": 5, "max_tokens": 3}, owner="LLM")
    assert resolve_aliases({"max_tokens": 7, "temperature": 0.5}) == {"max_new_tokens": 7, "temperature": 0.5}
    assert resolve_aliases({"max_tokens": None, "max_new_tokens": 9}) == {"max_new_tokens": 9}


def test_stop_from_the_call_replaces_the_default() -> None:
    assert call_params(DEFAULTS, {}, owner="LLM", stop=["END"])["stop"] == ["END"]
    # The keyword wins over the separate argument; one string is a list of one.
    assert call_params(DEFAULTS, {"stop": "STOP"}, owner="LLM", stop=["END"])["stop"] == ["STOP"]
    assert call_params(SimpleNamespace(**{**vars(DEFAULTS), "stop": []}), {}, owner="LLM")["stop"] is None
    with pytest.raises(TypeError, match="list of strings"):
        call_params(DEFAULTS, {"stop": [1]}, owner="LLM")


def test_unknown_parameters_are_both_value_and_type_errors() -> None:
    with pytest.raises(UnknownParameterError, match=r"ChatKVBoost got unknown parameter\(s\) \['top_k'\]") as info:
        call_params(DEFAULTS, {"top_k": 5}, owner="ChatKVBoost")
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    assert "documents" in str(info.value)
    # What the framework passes down by itself is ignored, not sent to the engine.
    assert "stream" not in call_params(DEFAULTS, {"stream": True}, owner="LLM", ignored=("stream",))


def test_documents_from_the_call_or_the_fallback() -> None:
    params = call_params(DEFAULTS, {"documents": ["a", Doc("b")]}, owner="LLM", documents=DOCS)
    assert params["documents"] == ["a", "b"]
    fallback = call_params(DEFAULTS, {}, owner="LLM", fallback_documents=[Doc("c")], documents=DOCS)
    assert fallback["documents"] == ["c"]
    chosen = call_params(DEFAULTS, {"documents": ["d"]}, owner="LLM", fallback_documents=["c"])
    assert chosen["documents"] == ["d"]
    assert document_texts([]) is None
    with pytest.raises(TypeError, match=r"list of strings or documents \(str or Doc\), got str"):
        document_texts("one text", DOCS)
    with pytest.raises(TypeError, match="items must be str or Doc, got int"):
        document_texts(["a", 3], DOCS)
    with pytest.raises(TypeError, match="items must be str, got Doc"):
        document_texts([Doc("b")])


def test_every_documented_name_is_a_call_parameter() -> None:
    names = {"max_new_tokens", "max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "stop", "reuse"}
    assert set(CALL_PARAMETERS) == names | {"documents"}
    assert CALL_PARAMETERS["max_tokens"] == "max_new_tokens"


# -- usage ----------------------------------------------------------------------------------


def test_usage_of_one_result_and_of_a_batch() -> None:
    first = GenerationResult(output_text="a", prompt_tokens=10, generated_tokens=3, cached_tokens=6, ttft_ms=2.0)
    second = GenerationResult(output_text="b", prompt_tokens=5, generated_tokens=2, cached_tokens=0)
    assert usage(first) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "cached_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 6},
    }
    total = usage([first, second])
    assert (total["prompt_tokens"], total["completion_tokens"], total["total_tokens"], total["cached_tokens"]) == (
        15,
        5,
        20,
        6,
    )
    figures = result_figures(first)
    assert figures["ttft_ms"] == 2.0 and figures["finish_reason"] == "length"
    assert not {"output_text", "token_ids", "first_token_logits", "step_logits"} & set(figures)


# -- tool keywords and the stream hold-back ---------------------------------------------------


def test_pop_call_format_takes_both_frameworks_names() -> None:
    kwargs: dict[str, Any] = {"tools": [TOOL], "tool_required": True, "allow_parallel_tool_calls": True, "seed": 1}
    fmt = pop_call_format(kwargs)
    assert kwargs == {"seed": 1}
    assert fmt.parses_tool_calls and fmt.parallel and fmt.constraint is not None
    same = pop_call_format({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": True})
    assert same == fmt
    # tool_choice wins over tool_required.
    text_only = pop_call_format({"tools": [TOOL], "tool_choice": "none", "tool_required": True})
    assert text_only == call_format([TOOL], "none")
    with pytest.raises(InvalidInputError, match="conflict"):
        pop_call_format({"tools": [TOOL], "parallel_tool_calls": True, "allow_parallel_tool_calls": False})
    with pytest.raises(InvalidInputError, match="not one of the bound tools"):
        pop_call_format({"tools": [TOOL], "tool_choice": "search"})
    converted = pop_call_format({"tools": ["lookup"]}, lambda name: TOOL)
    assert [spec.name for spec in converted.specs] == ["lookup"]
    assert pop_call_format({}) == CallFormat()


def _stream(hold: ToolCallHoldBack, pieces: list[str]) -> list[str]:
    return [shown for shown in map(hold.feed, pieces) if shown is not None]


def test_hold_back_shows_text_and_holds_a_call() -> None:
    fmt = call_format([TOOL], "auto")
    text = ToolCallHoldBack(fmt)
    assert _stream(text, ["It is ", "<b>", " here"]) == ["It is ", "<b>", " here"]
    assert text.finish("eos") is None and text.shown_text == "It is <b> here"
    call = ToolCallHoldBack(fmt)
    pieces = ["<tool_call>\n", '{"name": "lookup", ', '"arguments": {"section": "x"}}', "\n</tool_call>"]
    assert _stream(call, pieces) == [] and call.holding
    parsed = call.finish("eos")
    assert parsed is not None and [(c.name, c.arguments) for c in parsed.valid_calls] == [("lookup", {"section": "x"})]
    cut = ToolCallHoldBack(fmt)
    _stream(cut, ["<tool_call>\n", '{"name": "lookup", "argu'])
    assert cut.finish("length").invalid_calls  # a call cut by max_new_tokens is reported invalid
    # Without tools nothing is held, even text that starts with "<".
    plain = ToolCallHoldBack(CallFormat())
    assert _stream(plain, ["", "<html>"]) == ["", "<html>"] and plain.finish() is None


# -- prewarming -------------------------------------------------------------------------------


def test_prewarm_skips_empty_repeated_warm_and_oversized_documents(make_engine, docs, caplog) -> None:
    engine = make_engine()
    engine.warm_documents([docs[0]])
    long_text = " ".join(docs)
    texts = ["", "  ", docs[0], docs[1], docs[1], long_text, docs[2]]
    with caplog.at_level(logging.WARNING):
        stats = prewarm_texts(engine, texts, max_document_tokens=200, batch_size=1, split_hint="cut them")
    assert (stats.documents, stats.empty, stats.duplicates, stats.already_warm) == (7, 2, 1, 1)
    assert (stats.oversized, stats.warmed, stats.failed) == (1, 2, 0)
    assert [r.already_warm for r in stats.results] == [False, False]
    assert stats.new_tokens == sum(r.new_tokens for r in stats.results) > 0
    assert [f.doc_id for f in stats.failures] == ["document 5"] and "max_document_tokens=200" in stats.failures[0].error
    assert "document 5" in caplog.text and "cut them" in caplog.text
    assert engine.is_document_warm(docs[2]) and not engine.is_document_warm(long_text)
    assert "7 documents, 2 warmed" in stats.summary()


def test_prewarm_isolates_the_document_the_engine_refuses(make_engine, docs, monkeypatch) -> None:
    engine = make_engine()
    refusals = {docs[1]: InvalidInputError("bad document"), docs[3]: PromptTooLongError("too long behind the prefix")}
    batches = refuse_documents(monkeypatch, engine, refusals)
    labels = [f"doc-{i}" for i in range(5)]
    stats = prewarm_texts(engine, docs[:5], labels=labels, batch_size=5)
    assert batches == [5, 1, 1, 1, 1, 1]
    assert (stats.warmed, stats.failed, stats.oversized) == (3, 1, 1)
    assert {(f.doc_id, f.error) for f in stats.failures} == {
        ("doc-1", "InvalidInputError: bad document"),
        ("doc-3", "PromptTooLongError: too long behind the prefix"),
    }
    assert [engine.is_document_warm(text) for text in docs[:5]] == [True, False, True, False, True]


def test_prewarm_batches_and_checks_its_arguments(make_engine, docs, monkeypatch) -> None:
    engine = make_engine()
    batches = refuse_documents(monkeypatch, engine, {})
    assert prewarm_texts(engine, docs[:5], batch_size=2).warmed == 5
    assert batches == [2, 2, 1]
    with pytest.raises(ValueError, match="batch_size"):
        prewarm_texts(engine, docs, batch_size=0)
    with pytest.raises(ValueError, match="labels"):
        prewarm_texts(engine, docs[:2], labels=["one"])


def test_selection_and_limits(make_engine, docs) -> None:
    engine = make_engine()
    engine.warm_documents([docs[0]])
    assert texts_to_warm(engine, [docs[0], docs[1], "", docs[1], " ".join(docs)], max_document_tokens=200) == [docs[1]]
    assert texts_to_warm(engine, [docs[1]]) == [docs[1]]
    assert not engine.is_document_warm(docs[1])  # selecting warms nothing
    window = engine.context_window
    assert default_max_document_tokens(engine) == default_max_document_tokens(engine, engine) == window
    assert default_max_document_tokens(engine, SimpleNamespace(max_new_tokens=100)) == window - 100
    assert default_max_document_tokens(engine, SimpleNamespace(context_window=1000, max_new_tokens=100)) == 900
    assert check_max_document_tokens(engine, window) == window
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        check_max_document_tokens(engine, window + 1)
    with pytest.raises(ValueError, match=">= 1"):
        check_max_document_tokens(engine, 0)
