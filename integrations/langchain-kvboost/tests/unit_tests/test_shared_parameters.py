"""What ChatKVBoost / KVBoostLLM share with the LlamaIndex integration (kvboost_rag.integration):
LlamaIndex's names are accepted here too, and usage and figures have the same layout."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import pytest
from langchain_core.documents import Document
from langchain_core.tools import tool
from langchain_kvboost import ChatKVBoost, KVBoostLLM, KVBoostRetrievalWarmer
from pydantic import ValidationError

from kvboost_rag import InvalidInputError
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import record_calls

TEXTS = python_reference_documents(max_chars=220)[20:24]


@tool
def lookup(section: str) -> str:
    """Look up a section of the Python documentation."""
    return section


def test_llamaindex_tool_keywords_are_accepted(engine: Any) -> None:
    pytest.importorskip("llguidance", reason="tool calls need kvboost-rag[constrained]")
    chat = ChatKVBoost(engine=engine, max_new_tokens=48)
    question = [("human", "Find the library section.")]
    # tool_required means tool_choice="required"; allow_parallel_tool_calls is parallel_tool_calls.
    reply = chat.bind_tools([lookup]).invoke(question, tool_required=True, allow_parallel_tool_calls=False)
    assert [call["name"] for call in reply.tool_calls] == ["lookup"]
    with pytest.raises(InvalidInputError, match="conflict"):
        chat.bind_tools([lookup], parallel_tool_calls=True).invoke(question, allow_parallel_tool_calls=False)


def test_usage_and_figures_have_the_llamaindex_layout(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=3)
    result = llm.generate(["Hello there", "General Kenobi"])
    usage = result.llm_output["token_usage"]
    infos = [generation[0].generation_info for generation in result.generations]
    assert usage["prompt_tokens"] == sum(info["prompt_tokens"] for info in infos)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["cached_tokens"]}
    # Every figure of the result (LlamaIndex's raw holds the same), never its text or ids.
    assert {"recompute_ratio", "live_tokens", "strategy"} <= set(infos[0])
    assert not {"output_text", "token_ids"} & set(infos[0])


def test_call_parameters_and_aliases(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_calls(monkeypatch, engine, "stream")
    llm = KVBoostLLM(engine=engine, max_new_tokens=8)
    prompt = "Context:\n" + TEXTS[0] + "\n\nQuestion: why?\nAnswer:"
    list(llm.stream(prompt, max_tokens=2, stop="\n", documents=[Document(page_content=TEXTS[0])]))
    assert (calls[0]["max_new_tokens"], calls[0]["stop"], calls[0]["documents"]) == (2, ["\n"], [TEXTS[0]])
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['top_k'\]"):
        llm.invoke("Hello", top_k=2)


def test_retrieval_warmer_queues_only_documents_worth_warming(engine: Any) -> None:
    engine.warm_documents([TEXTS[0]])
    warmer = KVBoostRetrievalWarmer(engine, max_document_tokens=120, idle_seconds=0.0)
    long_text = " ".join(TEXTS)
    assert engine.count_tokens(long_text) > 120
    docs = [Document(page_content=text) for text in (TEXTS[0], TEXTS[1], long_text)]
    warmer.on_retriever_end(docs, run_id=uuid4())
    assert warmer.queued_documents == 1  # not the warm one, not the oversized one
    assert warmer.wait_idle(timeout=30)
    assert engine.is_document_warm(TEXTS[1]) and not engine.is_document_warm(long_text)
    warmer.close()


def test_names_from_before_the_shared_vocabulary_are_gone(engine: Any) -> None:
    with pytest.raises(ImportError):
        from langchain_kvboost import KVBoostRetrieverWarmer  # noqa: F401
    assert not hasattr(KVBoostRetrievalWarmer, "wait")
    for cls in (KVBoostLLM, ChatKVBoost):
        with pytest.raises(ValidationError, match=r"engine_kwargs\n.*Extra inputs are not permitted"):
            cls(engine=engine, engine_kwargs={})
        assert not hasattr(cls, "engine_kwargs")
    with pytest.raises(ValidationError, match=r"warm_system_prompt\n.*Extra inputs are not permitted"):
        ChatKVBoost(engine=engine, warm_system_prompt=True)
