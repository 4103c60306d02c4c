"""End-to-end RAG chain on the embedded model over the Python reference documents."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmer

from kvboost_rag.corpus import python_reference_documents, python_reference_topics

SYSTEM = (
    "You are a Python expert. Answer the question in one short sentence, "
    "using only the reference documents the user gives you."
)
QUESTIONS = (
    "How does the for statement loop over an iterable?",
    "What does the while loop statement do?",
)
#: Every fourth topic plus the ones the questions are about: a corpus big enough to retrieve
#: from, small enough to warm in seconds.
EXTRA_TOPICS = ("for", "while", "break", "continue", "subscriptions", "try", "with", "lists")
MAX_NEW_TOKENS = 24


def _corpus() -> list[Document]:
    names = list(python_reference_topics())
    texts = python_reference_documents(max_chars=400)
    chosen = set(names[::4]) | set(EXTRA_TOPICS)
    return [Document(page_content=t, metadata={"topic": n}) for n, t in zip(names, texts) if n in chosen]


def _format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


class Capture(BaseCallbackHandler):
    """Keeps the retrieved documents and the messages the chat model received."""

    def __init__(self) -> None:
        self.documents: list[Document] = []
        self.messages: list[BaseMessage] = []

    def on_retriever_end(self, documents: Any, **kwargs: Any) -> None:
        self.documents = list(documents)

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.messages = list(messages[0])


@pytest.mark.slow
def test_rag_chain_reuses_system_prompt_and_documents(embeddings: Any) -> None:
    chat = ChatKVBoost(max_new_tokens=MAX_NEW_TOKENS)
    engine = chat.engine
    store = KVBoostPrewarmer(chat).wrap(InMemoryVectorStore(embeddings))
    corpus = _corpus()
    store.add_documents(corpus)
    assert all(engine.is_document_warm(doc.page_content) for doc in corpus)

    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), ("human", "Reference documents:\n\n{context}\n\nQuestion: {question}")]
    )
    retriever = store.as_retriever(search_kwargs={"k": 3})
    chain = {"context": retriever | _format_docs, "question": RunnablePassthrough()} | prompt | chat

    first_capture, second_capture = Capture(), Capture()
    first = chain.invoke(QUESTIONS[0], config={"callbacks": [first_capture]})
    second = chain.invoke(QUESTIONS[1], config={"callbacks": [second_capture]})

    # The two questions share documents, retrieved at different positions.
    first_docs = [d.page_content for d in first_capture.documents]
    second_docs = [d.page_content for d in second_capture.documents]
    shared = [d for d in second_docs if d in first_docs]
    assert shared, "the questions should retrieve overlapping documents"
    assert any(first_docs.index(d) != second_docs.index(d) for d in shared)

    meta = second.response_metadata
    # The system prompt (stored by the first answer's write-back) is reused by prefix hash ...
    system_turn = engine.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert meta["prefix_hit_tokens"] >= engine.count_tokens(system_turn)
    # ... and the documents, in their new order, by content hash.
    assert meta["documents_found"] == len(second_docs)
    assert meta["content_hit_tokens"] > 0
    assert second.usage_metadata["input_token_details"]["cache_read"] == meta["cached_tokens"]
    assert meta["kv_reuse_ratio"] > 0.5
    assert first.response_metadata["content_hit_tokens"] > 0

    # The chain's answer is the engine's own output for the very prompt the chain built.
    rendered = chat.render_prompt(second_capture.messages)
    assert second.content == engine.generate(rendered, max_new_tokens=MAX_NEW_TOKENS).output_text
