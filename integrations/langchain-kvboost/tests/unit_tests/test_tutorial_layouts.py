"""The RAG layouts LangChain's tutorials teach, context in the system message, after prewarm.

Each layout must take most of its document tokens from cache (by content hash, wherever the
documents land) and must not grow memory per query beyond the non-document text.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmer

from kvboost_rag.corpus import python_reference_documents

pytest.importorskip("langchain_classic", reason="the tutorial chains live in langchain-classic (test extra)")

from langchain_classic.chains import create_retrieval_chain  # noqa: E402
from langchain_classic.chains.combine_documents import create_stuff_documents_chain  # noqa: E402

#: The system prompt of LangChain's RAG tutorial: the retrieved context is in the system message.
TUTORIAL_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\n\n{context}"
)
QUESTIONS = (
    "What does the assert statement check?",
    "How does the for statement loop?",
    "What does the while statement do?",
    "How are exceptions raised?",
)
#: Share of the prompt's document tokens that must come from cache after prewarm.
MIN_DOCUMENT_HIT_SHARE = 0.8


class LastGeneration(BaseCallbackHandler):
    """Keeps the ``generation_info`` of the last model call."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.info = dict(response.generations[0][0].generation_info or {})


def _prompt() -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", TUTORIAL_SYSTEM), ("human", "{input}")])


def _bytes_per_token(engine: Any) -> int:
    config = engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(engine.model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def _check_query(chat: ChatKVBoost, meta: dict[str, Any], documents: list[str]) -> int:
    """Assert the documents hit; return the prompt's non-document tokens."""
    engine = chat.engine
    document_tokens = sum(engine.count_tokens(text) for text in documents)
    assert meta["documents_found"] == len(documents)
    assert meta["content_hit_tokens"] >= MIN_DOCUMENT_HIT_SHARE * document_tokens
    # Honest counters: only loaded tokens, never more than the prompt minus its last token.
    assert meta["cached_tokens"] == meta["prefix_hit_tokens"] + meta["content_hit_tokens"] - meta["recomputed_tokens"] < meta["prompt_tokens"]
    return max(0, meta["prompt_tokens"] - document_tokens)


def _run_layout(chat: ChatKVBoost, ask: Any) -> None:
    """Ask every question through ``ask`` and check hits and memory after each."""
    engine = chat.engine
    per_token = _bytes_per_token(engine)
    before = engine.cache_stats().memory_bytes
    non_document_tokens = 0
    for question in QUESTIONS:
        meta, documents = ask(question)
        non_document_tokens += _check_query(chat, meta, documents)
        grown = engine.cache_stats().memory_bytes - before
        assert grown <= per_token * non_document_tokens, "memory grew beyond the non-document text"


@pytest.fixture
def warmed(make_engine: Any, embeddings: Any) -> tuple[ChatKVBoost, Any]:
    chat = ChatKVBoost(engine=make_engine(), max_new_tokens=4)
    store = KVBoostPrewarmer(chat).wrap(InMemoryVectorStore(embeddings))
    store.add_texts(python_reference_documents(max_chars=300)[:16])
    return chat, store.as_retriever(search_kwargs={"k": 4})


def test_create_retrieval_chain_with_context_in_the_system_message(warmed: tuple[ChatKVBoost, Any]) -> None:
    chat, retriever = warmed
    chain = create_retrieval_chain(retriever, create_stuff_documents_chain(chat, _prompt()))

    def ask(question: str) -> tuple[dict[str, Any], list[str]]:
        last = LastGeneration()
        out = chain.invoke({"input": question}, config={"callbacks": [last]})
        return last.info, [d.page_content for d in out["context"]]

    _run_layout(chat, ask)


def test_create_stuff_documents_chain_with_context_in_the_system_message(warmed: tuple[ChatKVBoost, Any]) -> None:
    chat, retriever = warmed
    chain = create_stuff_documents_chain(chat, _prompt())

    def ask(question: str) -> tuple[dict[str, Any], list[str]]:
        last = LastGeneration()
        docs = retriever.invoke(question)
        chain.invoke({"context": docs, "input": question}, config={"callbacks": [last]})
        return last.info, [d.page_content for d in docs]

    _run_layout(chat, ask)
