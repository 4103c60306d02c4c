"""Integration: LlamaIndex's ``FunctionAgent`` and ``ReActAgent`` on the embedded model, with a
retriever tool over prewarmed Python reference documents.

Each agent searches, then answers; the answering step reads the documents the tool returned
from cache (warmed at ingest by ``KVBoostPrewarmer``) and the first step's prompt by prefix.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.tools import RetrieverTool
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer

from kvboost_rag.corpus import python_reference_topics

pytest.importorskip("llguidance", reason="tool calls need kvboost-rag[constrained]")

pytestmark = pytest.mark.slow

TOPICS = ("for", "while", "with", "try", "assert", "pass", "break", "continue", "global", "lambda")
K = 2
SYSTEM = "You are a Python expert. Search the Python docs with the tool, then answer in one sentence."


@pytest.fixture(scope="module")
def retriever_tool(hash_embedding: Any) -> RetrieverTool:
    llm = KVBoostLLM(max_new_tokens=48, repetition_penalty=1.2)
    topics = python_reference_topics()
    documents = [Document(text=topics[name][:400], metadata={"topic": name}) for name in TOPICS]
    index = VectorStoreIndex.from_documents(
        documents,
        transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0), KVBoostPrewarmer(llm=llm)],
        embed_model=hash_embedding,
    )
    return RetrieverTool.from_defaults(
        index.as_retriever(similarity_top_k=K),
        name="search_python_docs",
        description="Search the Python reference documentation; returns the most relevant sections.",
    )


def _run(agent: Any, question: str) -> Any:
    async def run() -> Any:
        return await agent.run(question, max_iterations=4)

    return asyncio.run(run())


def _answer_read_the_documents_from_cache(calls: list[dict[str, Any]]) -> None:
    """The agent's LLM calls were a search, then an answer whose documents came from cache."""
    search, answer = calls
    # the K retrieved documents, and any block of the first turn's text it stored
    assert answer["raw"]["documents_found"] >= K
    assert answer["raw"]["content_hit_tokens"] > 0
    assert answer["raw"]["prefix_hit_tokens"] >= search["raw"]["prompt_tokens"] // 2
    assert answer["raw"]["cached_tokens"] > answer["raw"]["prompt_tokens"] // 2


@pytest.mark.parametrize("question", ["What does the with statement do?", "What does the assert statement do?"])
def test_function_agent_searches_then_answers(retriever_tool: RetrieverTool, recorder: Any, question: str) -> None:
    llm = KVBoostLLM(max_new_tokens=48, repetition_penalty=1.2)
    agent = FunctionAgent(tools=[retriever_tool], llm=llm, initial_tool_choice="search_python_docs", system_prompt=SYSTEM)
    answer = _run(agent, question)
    [call] = answer.tool_calls
    assert call.tool_name == "search_python_docs" and isinstance(call.tool_kwargs["input"], str)
    assert str(answer).strip()
    _answer_read_the_documents_from_cache(recorder.calls)


@pytest.mark.parametrize("question", ["What does the with statement do?", "What does the assert statement do?"])
def test_react_agent_searches_then_answers(retriever_tool: RetrieverTool, recorder: Any, question: str) -> None:
    # react_tool_steps=1: search first, then answer (left to choose, the 135M model answers at once).
    llm = KVBoostLLM(max_new_tokens=64, repetition_penalty=1.2, react_tool_steps=1)
    agent = ReActAgent(tools=[retriever_tool], llm=llm, system_prompt=SYSTEM)
    answer = _run(agent, question)
    [call] = answer.tool_calls
    assert call.tool_name == "search_python_docs" and isinstance(call.tool_kwargs["input"], str)
    assert str(answer).strip() and "Thought:" not in str(answer)
    _answer_read_the_documents_from_cache(recorder.calls)
