"""The per-call parameters, tool keywords and prewarming KVBoostLLM shares with the LangChain
integration (kvboost_rag.integration): the same names and aliases, and the same behaviour."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.core.tools import FunctionTool
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer, node_prompt_text

from kvboost_rag import InvalidInputError, KVBoost
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import record_calls, refuse_documents

TEXTS = python_reference_documents(max_chars=240)[:6]


def _context_prompt(texts: list[str], question: str) -> str:
    return "Context:\n" + "\n\n".join(texts) + f"\n\nQuestion: {question}\nAnswer:"


def test_documents_keyword_takes_strings_and_nodes(tiny_engine: KVBoost, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=2)
    calls = record_calls(monkeypatch, tiny_engine, "generate")
    node = TextNode(text=TEXTS[1], metadata={"topic": "x"})
    prompt = _context_prompt([TEXTS[0], node_prompt_text(node)], "why?")
    first = llm.complete(prompt, formatted=True, documents=[TEXTS[0], NodeWithScore(node=node, score=0.5)])
    assert calls[0]["documents"] == [TEXTS[0], node_prompt_text(node)]
    assert first.raw["documents_found"] == 2
    # The documents were cut on their boundaries and stored: swapped, they hit by content.
    again = llm.complete(_context_prompt([node_prompt_text(node), TEXTS[0]], "how?"), formatted=True)
    assert again.raw["documents_found"] == 2 and again.raw["content_hit_tokens"] > 0
    with pytest.raises(TypeError, match="list of strings or documents"):
        llm.complete("x", documents=TEXTS[0])
    with pytest.raises(TypeError, match="items must be str, a node or a NodeWithScore, got int"):
        llm.complete("x", documents=[3])


def test_documents_keyword_on_chat_and_streams(tiny_engine: KVBoost, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=2)
    calls = record_calls(monkeypatch, tiny_engine, "stream")
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Context:\n" + TEXTS[2]),
        ChatMessage(role=MessageRole.USER, content="Why?"),
    ]
    last = list(llm.stream_chat(messages, documents=[TEXTS[2]]))[-1]
    assert calls[0]["documents"] == [TEXTS[2]] and last.raw["documents_found"] == 1


def test_aliases_and_stop_as_in_langchain(tiny_engine: KVBoost, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_tokens=3)  # LangChain's standard name, at construction too
    assert llm.max_new_tokens == 3
    with pytest.raises(ValueError, match="conflict"):
        KVBoostLLM(engine=tiny_engine, max_tokens=3, max_new_tokens=4)
    calls = record_calls(monkeypatch, tiny_engine, "generate")
    llm.complete("Hello", max_tokens=2, stop="\n")
    assert (calls[0]["max_new_tokens"], calls[0]["stop"]) == (2, ["\n"])
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['top_k'\]"):
        llm.complete("Hello", top_k=3)
    with pytest.raises(InvalidInputError, match="unknown parameter"):
        llm.chat([ChatMessage(role="user", content="Hi")], api_base="x")


def test_tool_keywords_of_both_frameworks(tiny_engine: KVBoost) -> None:
    pytest.importorskip("llguidance", reason="tool calls need kvboost-rag[constrained]")

    def lookup(section: str) -> str:
        """Look up a section of the Python documentation."""
        return section

    tool = FunctionTool.from_defaults(fn=lookup)
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=48)
    messages = [ChatMessage(role="user", content="Find the library section.")]
    # A BaseTool as is (not only an OpenAI definition), LangChain's parallel_tool_calls name.
    response = llm.chat(messages, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "lookup"
    with pytest.raises(InvalidInputError, match="conflict"):
        llm.chat(messages, tools=[tool], parallel_tool_calls=True, allow_parallel_tool_calls=False)
    with pytest.raises(InvalidInputError, match="BaseTool or an OpenAI-style definition"):
        llm.chat(messages, tools=[object()])


def test_prewarm_isolates_a_failing_node(tiny_engine: KVBoost, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    nodes = [TextNode(text=text, id_=f"n{i}") for i, text in enumerate(TEXTS[:4])]
    refuse_documents(monkeypatch, tiny_engine, {TEXTS[1]: InvalidInputError("not text")})
    prewarm = KVBoostPrewarmer(engine=tiny_engine, batch_size=4)
    with caplog.at_level(logging.WARNING):
        assert prewarm(nodes) is nodes
    stats = prewarm.last_stats
    assert (stats.nodes, stats.warmed, stats.failed) == (4, 3, 1)
    assert [(f.doc_id, f.error) for f in stats.failures] == [("node n1", "InvalidInputError: not text")]
    assert "node n1" in caplog.text
    assert [tiny_engine.is_document_warm(t) for t in TEXTS[:4]] == [True, False, True, True]
