"""KVBoostPrewarmer and PrewarmingVectorStore on a tiny random-weight model."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_kvboost import (
    ChatKVBoost,
    KVBoostLLM,
    KVBoostPrewarmer,
    PrewarmingVectorStore,
)

from kvboost_rag import InvalidInputError
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.testing import refuse_documents

TEXTS = python_reference_documents(max_chars=200)[:8]


def _docs(texts: list[str]) -> list[Document]:
    return [Document(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(texts)]


def test_transformer_warms_and_returns_documents_unchanged(engine: Any) -> None:
    docs = _docs(TEXTS[:3])
    prewarmer = KVBoostPrewarmer(KVBoostLLM(engine=engine))
    assert not any(engine.is_document_warm(d.page_content) for d in docs)
    out = prewarmer.transform_documents(docs)
    assert out is docs
    assert all(engine.is_document_warm(d.page_content) for d in docs)


async def test_async_transformer_warms(engine: Any) -> None:
    docs = _docs(TEXTS[3:5])
    out = await KVBoostPrewarmer(engine).atransform_documents(docs)
    assert list(out) == docs
    assert all(engine.is_document_warm(d.page_content) for d in docs)


def test_documents_are_rendered_with_the_chains_document_prompt(engine: Any) -> None:
    docs = _docs(TEXTS[:2])
    prewarmer = KVBoostPrewarmer(ChatKVBoost(engine=engine), document_prompt="[{source}]\n{page_content}")
    rendered = prewarmer.render(docs)
    assert rendered == [f"[doc{i}]\n{t}" for i, t in enumerate(TEXTS[:2])]
    prewarmer.warm(docs)
    assert all(engine.is_document_warm(text) for text in rendered)


def test_already_warm_and_repeated_documents_are_skipped(engine: Any) -> None:
    prewarmer = KVBoostPrewarmer(engine)
    first = prewarmer.warm_texts([TEXTS[0], TEXTS[1], TEXTS[0], "   "])
    assert len(first) == 2
    assert not any(r.already_warm for r in first)
    assert all(r.new_tokens > 0 for r in first)
    assert (prewarmer.last_stats.duplicates, prewarmer.last_stats.empty) == (1, 1)
    again = prewarmer.warm_texts([TEXTS[1], TEXTS[0], TEXTS[2]])
    # Texts the engine holds are skipped before the engine is called: one result, for TEXTS[2].
    assert [r.already_warm for r in again] == [False]
    stats = prewarmer.last_stats
    assert (stats.documents, stats.already_warm, stats.warmed) == (3, 2, 1)
    assert stats.new_tokens == again[0].new_tokens > 0


def test_a_failing_document_fails_alone(engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    calls = refuse_documents(monkeypatch, engine, {TEXTS[2]: InvalidInputError("document is not text")})
    prewarmer = KVBoostPrewarmer(engine, batch_size=4)
    with caplog.at_level(logging.WARNING):
        results = prewarmer.warm(_docs(TEXTS[:6]))
    # The batch holding the bad document was retried one document at a time.
    assert calls == [4, 1, 1, 1, 1, 2]
    assert len(results) == 5 and prewarmer.last_stats.warmed == 5
    assert [d for d in TEXTS[:6] if not engine.is_document_warm(d)] == [TEXTS[2]]
    (failure,) = prewarmer.last_stats.failures
    assert (failure.doc_id, failure.error) == ("document 2 (doc2)", "InvalidInputError: document is not text")
    assert prewarmer.last_stats.failed == 1
    assert "document 2 (doc2)" in caplog.text


def test_oversized_documents_are_skipped_with_a_warning(engine: Any, caplog: Any) -> None:
    long_text = " ".join(TEXTS)
    llm = KVBoostLLM(engine=engine, max_new_tokens=16)
    assert KVBoostPrewarmer(llm).max_document_tokens == engine.context_window - 16
    prewarmer = KVBoostPrewarmer(llm, max_document_tokens=100)
    with caplog.at_level(logging.WARNING):
        prewarmer.warm_texts([long_text, TEXTS[0]])
    assert not engine.is_document_warm(long_text) and engine.is_document_warm(TEXTS[0])
    stats = prewarmer.last_stats
    assert (stats.oversized, stats.warmed) == (1, 1)
    assert stats.failures[0].doc_id == "document 0" and stats.failures[0].error.startswith("oversized: ")
    assert "max_document_tokens=100" in caplog.text and "RecursiveCharacterTextSplitter" in caplog.text
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        KVBoostPrewarmer(engine, max_document_tokens=engine.context_window + 1)


def test_progress_bar_only_for_large_batches(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    prewarmer = KVBoostPrewarmer(engine, progress_min_documents=3)
    prewarmer.warm_texts(TEXTS[:2])
    assert "warming documents" not in capsys.readouterr().err
    prewarmer.warm_texts(TEXTS[2:5])
    assert "warming documents" in capsys.readouterr().err
    with pytest.raises(ValueError, match="progress_min_documents"):
        KVBoostPrewarmer(engine, progress_min_documents=0)


def test_prewarmer_needs_a_kvboost_engine() -> None:
    with pytest.raises(TypeError, match="KVBoost"):
        KVBoostPrewarmer(object())


def test_vector_store_wrapper_warms_then_delegates(engine: Any, embeddings: Any) -> None:
    inner = InMemoryVectorStore(embeddings)
    store = KVBoostPrewarmer(engine).wrap(inner)
    assert isinstance(store, PrewarmingVectorStore)
    ids = store.add_documents(_docs(TEXTS[:3]))
    assert len(ids) == 3 and len(inner.store) == 3
    assert all(engine.is_document_warm(t) for t in TEXTS[:3])
    more = store.add_texts(TEXTS[3:5], metadatas=[{"source": "a"}, {"source": "b"}], ids=["a", "b"])
    assert more == ["a", "b"]
    assert all(engine.is_document_warm(t) for t in TEXTS[3:5])
    assert [d.page_content for d in store.get_by_ids(["a"])] == [TEXTS[3]]
    # Searches go to the wrapped store, retrievers included.
    query = TEXTS[4][:80]
    assert store.similarity_search(query, k=1)[0].page_content == TEXTS[4]
    assert store.as_retriever(search_kwargs={"k": 1}).invoke(query)[0].page_content == TEXTS[4]
    assert store.embeddings is embeddings
    assert store.store is inner.store  # other attributes of the wrapped store
    store.delete(["a"])
    assert store.get_by_ids(["a"]) == []
    with pytest.raises(ValueError, match="metadatas"):
        store.add_texts(TEXTS[:2], metadatas=[{}])


async def test_vector_store_wrapper_async_paths(engine: Any, embeddings: Any) -> None:
    store = KVBoostPrewarmer(engine).wrap(InMemoryVectorStore(embeddings))
    await store.aadd_documents(_docs(TEXTS[5:6]))
    await store.aadd_texts(TEXTS[6:8])
    assert all(engine.is_document_warm(t) for t in TEXTS[5:8])
    found = await store.asimilarity_search(TEXTS[6][:80], k=1)
    assert found[0].page_content == TEXTS[6]


def test_from_texts_warms_builds_and_wraps(engine: Any, embeddings: Any) -> None:
    prewarmer = KVBoostPrewarmer(engine)
    store = PrewarmingVectorStore.from_texts(
        TEXTS[:2], embeddings, vectorstore_cls=InMemoryVectorStore, prewarmer=prewarmer
    )
    assert isinstance(store.vectorstore, InMemoryVectorStore)
    assert all(engine.is_document_warm(t) for t in TEXTS[:2])
    with pytest.raises(ValueError, match="vectorstore_cls"):
        PrewarmingVectorStore.from_texts(TEXTS[:1], embeddings)


def test_restarted_app_over_the_same_disk_folder_hits_without_prewarming(make_engine: Any, tmp_path: Any) -> None:
    KVBoostPrewarmer(KVBoostLLM(engine=make_engine(disk_cache_dir=tmp_path))).transform_documents(_docs(TEXTS[:3]))

    restarted = KVBoostLLM(engine=make_engine(disk_cache_dir=tmp_path), max_new_tokens=2)
    prompt = "Answer from these.\n\n" + "\n\n".join(TEXTS[2::-1]) + "\n\nQuestion: why?\nAnswer:"
    info = restarted.generate([prompt]).generations[0][0].generation_info
    assert info["documents_found"] == 3 and info["content_hit_tokens"] > 0
