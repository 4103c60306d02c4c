"""KVBoostRetrievalWarmer on a tiny random-weight model."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import KVBoostLLM, KVBoostRetrievalWarmer

from kvboost_rag.corpus import python_reference_documents

TEXTS = python_reference_documents(max_chars=200)[10:20]
PROMPT = PromptTemplate.from_template(
    "Answer from the context.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:"
)


def _format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


class StateAtLLMStart(BaseCallbackHandler):
    """Records, when the LLM starts, how many documents the warmer and the engine hold.

    (``engine.is_document_warm`` is not used here: it registers the text it checks.)
    """

    def __init__(self, engine: Any, warmer: KVBoostRetrievalWarmer) -> None:
        self.engine = engine
        self.warmer = warmer
        self.seen: tuple[int, int] | None = None

    def on_llm_start(self, serialized: Any, prompts: Any, **kwargs: Any) -> None:
        self.seen = (self.warmer.warmed_documents, self.engine.cache_stats().documents)


def _store(embeddings: Any) -> InMemoryVectorStore:
    store = InMemoryVectorStore(embeddings)
    store.add_texts(TEXTS)
    return store


def test_retrieved_documents_are_warmed_after_the_chain_ends(make_engine: Any, embeddings: Any) -> None:
    # Blocks off: the first look would store its documents as blocks, and the warmer would
    # find them warm already.
    engine = make_engine(store_prompt_blocks=False)
    llm = KVBoostLLM(engine=engine, max_new_tokens=8)
    retriever = _store(embeddings).as_retriever(search_kwargs={"k": 2})
    chain = {"context": retriever | _format_docs, "question": RunnablePassthrough()} | PROMPT | llm | StrOutputParser()
    question = TEXTS[3][:60]
    retrieved = [d.page_content for d in retriever.invoke(question)]
    swapped = "\n\n".join(reversed(retrieved))

    def swapped_prompt(header: str) -> str:
        # A new header each time, so no earlier prompt's prefix covers the documents.
        return f"{header}\n\nContext:\n{swapped}\n\nQuestion: why?\nAnswer:"

    # Before: the documents are unknown to the engine, so a prompt holding them hits nothing.
    assert llm.generate([swapped_prompt("First look.")]).generations[0][0].generation_info["content_hit_tokens"] == 0

    warmer = KVBoostRetrievalWarmer(llm)
    probe = StateAtLLMStart(engine, warmer)
    chain.invoke(question, config={"callbacks": [warmer, probe]})
    assert probe.seen == (0, 0), "warming must not run before the answer"
    assert warmer.wait_idle(timeout=30)
    assert all(engine.is_document_warm(t) for t in retrieved)
    assert warmer.warmed_documents == 2

    # After: the same documents in another order are served from cache by content hash.
    info = llm.generate([swapped_prompt("Second look.")]).generations[0][0].generation_info
    assert info["content_hit_tokens"] > 0
    warmer.close()


def test_warms_right_away_when_only_the_retriever_is_observed(engine: Any, embeddings: Any) -> None:
    warmer = KVBoostRetrievalWarmer(engine)
    retriever = _store(embeddings).as_retriever(search_kwargs={"k": 3})
    docs = retriever.invoke(TEXTS[5][:60], config={"callbacks": [warmer]})
    assert warmer.wait_idle(timeout=30)
    assert all(engine.is_document_warm(d.page_content) for d in docs)
    # A second retrieval of warm documents computes nothing new.
    before = warmer.warmed_documents
    retriever.invoke(TEXTS[5][:60], config={"callbacks": [warmer]})
    assert warmer.wait_idle(timeout=30)
    assert warmer.warmed_documents == before == 3
    warmer.close()


def test_document_prompt_is_applied(engine: Any, embeddings: Any) -> None:
    warmer = KVBoostRetrievalWarmer(engine, document_prompt="Source text:\n{page_content}")
    docs = _store(embeddings).as_retriever(search_kwargs={"k": 1}).invoke(TEXTS[7][:60], config={"callbacks": [warmer]})
    assert warmer.wait_idle(timeout=30)
    assert engine.is_document_warm("Source text:\n" + docs[0].page_content)
    warmer.close()
