"""LangGraph's prebuilt ReAct agent on the embedded model, with a retriever tool.

The corpus is prewarmed at ingest (``KVBoostPrewarmer``); the agent calls the retriever tool,
and the documents the tool returns are read from cache when the model answers.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, create_retriever_tool
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmer

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents, python_reference_topics

pytest.importorskip("llguidance", reason="tool calling needs kvboost-rag[constrained]")
prebuilt = pytest.importorskip("langgraph.prebuilt", reason="the agent tests need langgraph (the [test] extra)")

SYSTEM = (
    "You are a Python expert. Search the Python reference documentation with the tool, then "
    "answer the question in one sentence using what the search returned."
)
TOPICS = ("for", "while", "with", "try", "assert", "pass", "break", "continue", "global", "lambda")
QUESTIONS = ("What does the with statement do?", "What does the assert statement do?")
K = 2


@pytest.fixture(scope="module")
def chat() -> ChatKVBoost:
    # An engine of its own: what earlier tests' prompts stored (their blocks) stays out of it.
    return ChatKVBoost(engine=KVBoost.from_pretrained(show_progress=False), max_new_tokens=48, repetition_penalty=1.2)


@pytest.fixture(scope="module")
def retriever_tool(chat: ChatKVBoost, embeddings: Any) -> BaseTool:
    topics = python_reference_topics()
    texts = dict(zip(topics, python_reference_documents(max_chars=400)))
    store = KVBoostPrewarmer(chat).wrap(InMemoryVectorStore(embeddings))
    store.add_documents([Document(page_content=texts[name], metadata={"topic": name}) for name in TOPICS])
    return create_retriever_tool(
        store.as_retriever(search_kwargs={"k": K}),
        "search_python_docs",
        "Search the Python reference documentation; returns the most relevant sections.",
    )


def _react_agent(chat: ChatKVBoost, tool: BaseTool) -> Any:
    """``create_react_agent`` with a model chosen per step: a call of the tool first (a 135M
    model left to choose often answers without searching), then an answer from what it found."""

    def model(state: dict[str, Any], runtime: Any) -> Any:
        searched = isinstance(state["messages"][-1], ToolMessage)
        return chat.bind_tools([tool], tool_choice="none" if searched else "any")

    with warnings.catch_warnings():
        # create_react_agent is deprecated in LangGraph 1.x in favour of langchain's
        # create_agent; it still works and is what the issue names.
        warnings.simplefilter("ignore")
        return prebuilt.create_react_agent(model, [tool], prompt=SYSTEM)


@pytest.mark.slow
@pytest.mark.parametrize("question", QUESTIONS)
def test_react_agent_searches_then_answers_from_cached_documents(
    chat: ChatKVBoost, retriever_tool: BaseTool, question: str
) -> None:
    engine = chat.engine
    state = _react_agent(chat, retriever_tool).invoke({"messages": [HumanMessage(question)]})
    human, call, result, answer = state["messages"]
    assert isinstance(call, AIMessage) and isinstance(result, ToolMessage)
    [made] = call.tool_calls
    assert made["name"] == "search_python_docs" and isinstance(made["args"]["query"], str)
    assert call.invalid_tool_calls == [] and result.tool_call_id == made["id"]
    assert isinstance(answer, AIMessage) and answer.content and not answer.tool_calls

    # Second turn: the retrieved documents, warmed at ingest, are read from cache by content
    # hash, and the first turn's prompt (system message with the tool) by prefix.
    meta = answer.response_metadata
    assert meta["documents_found"] >= K  # the K retrieved documents, and any block of the first turn it stored
    documents_tokens = sum(engine.count_tokens(text) for text in result.content.split("\n\n"))
    assert meta["content_hit_tokens"] >= documents_tokens // 2
    assert meta["prefix_hit_tokens"] >= call.usage_metadata["input_tokens"] // 2
    assert answer.usage_metadata["input_token_details"]["cache_read"] == meta["cached_tokens"] > documents_tokens // 2
