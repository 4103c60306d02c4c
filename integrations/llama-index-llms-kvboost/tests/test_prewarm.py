"""KVBoostPrewarmer and the retrieval-end warmer on a tiny engine.

The background queue itself is tested in the engine suite (tests/test_background_warmer.py).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.ingestion.pipeline import get_transformation_hash
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, TextNode
from llama_index.llms.kvboost import (
    KVBoostLLM,
    KVBoostPrewarmer,
    node_prompt_text,
)

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_topics

TOPICS = ("assert", "break", "continue", "del", "global", "pass", "return", "yield")


def _documents(max_chars: int = 700) -> list[Document]:
    topics = python_reference_topics()
    return [Document(text=topics[name][:max_chars], metadata={"topic": name}) for name in TOPICS]


def _nodes() -> list[TextNode]:
    return SentenceSplitter(chunk_size=96, chunk_overlap=0).get_nodes_from_documents(_documents())


def test_prewarm_warms_the_llm_text_and_returns_nodes_unchanged(tiny_engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=tiny_engine)
    nodes = _nodes()
    before = [node.model_dump() for node in nodes]
    prewarm = KVBoostPrewarmer(llm=llm)
    out = prewarm(nodes)
    assert out is nodes and [node.model_dump() for node in out] == before
    texts = {node_prompt_text(node) for node in nodes}
    assert all(tiny_engine.is_document_warm(text) for text in texts)
    # The warmed text is the LLM view, metadata included, not the bare node text.
    assert "topic: " in node_prompt_text(nodes[0])
    assert not tiny_engine.is_document_warm(nodes[0].get_content(metadata_mode=MetadataMode.NONE))
    stats = prewarm.last_stats
    assert (stats.nodes, stats.warmed, stats.already_warm) == (len(nodes), len(texts), 0)
    assert stats.new_tokens == sum(tiny_engine.count_tokens(t) for t in texts)


def test_second_prewarm_skips_warm_nodes(tiny_engine: KVBoost) -> None:
    prewarm = KVBoostPrewarmer(engine=tiny_engine)
    nodes = _nodes()
    prewarm(nodes)
    first_ms = prewarm.last_stats.elapsed_ms
    prewarm(nodes)
    again = prewarm.last_stats
    assert again.warmed == 0 and again.new_tokens == 0
    assert again.already_warm == len({node_prompt_text(n) for n in nodes})
    assert again.elapsed_ms < first_ms


def test_empty_duplicate_and_oversized_nodes(tiny_engine: KVBoost, caplog: pytest.LogCaptureFixture) -> None:
    long_text = python_reference_topics()["assert"][:1200]
    nodes = [
        TextNode(text=""),
        TextNode(text="   \n"),
        TextNode(text="A short node about the pass statement, long enough to anchor."),
        TextNode(text="A short node about the pass statement, long enough to anchor."),
        TextNode(text=long_text),
    ]
    prewarm = KVBoostPrewarmer(engine=tiny_engine, max_document_tokens=64)
    with caplog.at_level(logging.WARNING, logger="llama_index.llms.kvboost.prewarm"):
        out = prewarm(nodes)
    assert out is nodes
    stats = prewarm.last_stats
    assert (stats.empty, stats.duplicates, stats.oversized, stats.warmed) == (2, 1, 1, 1)
    assert "max_document_tokens=64" in caplog.text and "SentenceSplitter" in caplog.text
    assert not tiny_engine.is_document_warm(long_text)
    assert tiny_engine.is_document_warm(nodes[2].text)


def test_prewarm_construction_errors(tiny_engine: KVBoost) -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        KVBoostPrewarmer()
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        KVBoostPrewarmer(engine=tiny_engine, max_document_tokens=tiny_engine.context_window + 1)
    llm = KVBoostLLM(engine=tiny_engine, context_window=1024, max_new_tokens=100)
    assert KVBoostPrewarmer(llm=llm).max_document_tokens == 924


def test_async_prewarm(tiny_engine: KVBoost) -> None:
    prewarm = KVBoostPrewarmer(engine=tiny_engine)
    nodes = _nodes()
    out = asyncio.run(prewarm.acall(nodes))
    assert out is nodes
    assert all(tiny_engine.is_document_warm(node_prompt_text(n)) for n in nodes)


def test_ingestion_pipeline_and_index_insert_warm_nodes(tiny_engine: KVBoost, hash_embedding) -> None:
    prewarm = KVBoostPrewarmer(engine=tiny_engine)
    splitter = SentenceSplitter(chunk_size=96, chunk_overlap=0)
    nodes = IngestionPipeline(transformations=[splitter, prewarm]).run(documents=_documents()[:3])
    assert nodes and all(tiny_engine.is_document_warm(node_prompt_text(n)) for n in nodes)

    index = VectorStoreIndex.from_documents(
        _documents()[3:5], transformations=[splitter, prewarm], embed_model=hash_embedding
    )
    extra = Document(text=python_reference_topics()["nonlocal"][:500], metadata={"topic": "nonlocal"})
    index.insert(extra)
    inserted = [n for n in index.docstore.docs.values() if n.metadata.get("topic") == "nonlocal"]
    assert inserted and all(tiny_engine.is_document_warm(node_prompt_text(n)) for n in inserted)


def test_pipeline_cache_never_skips_a_fresh_prewarm(tiny_engine: KVBoost) -> None:
    nodes = _nodes()[:2]
    first, second = KVBoostPrewarmer(engine=tiny_engine), KVBoostPrewarmer(engine=tiny_engine)
    assert get_transformation_hash(nodes, first) == get_transformation_hash(nodes, first)
    assert get_transformation_hash(nodes, first) != get_transformation_hash(nodes, second)


def test_retrieval_warmer_warms_retrieved_nodes_in_background(tiny_engine: KVBoost, hash_embedding) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4)
    index = VectorStoreIndex(_nodes(), embed_model=hash_embedding)
    warmer = llm.enable_retrieval_warming(idle_seconds=0.05)
    try:
        assert warmer in get_dispatcher().event_handlers
        retrieved = index.as_retriever(similarity_top_k=2).retrieve("yield expression in a generator")
        assert warmer.queued_documents == 2
        assert warmer.wait_idle(timeout=60)
        assert all(tiny_engine.is_document_warm(node_prompt_text(r.node)) for r in retrieved)
        assert warmer.warmer.warmed_documents == 2
    finally:
        warmer.detach()
    assert warmer not in get_dispatcher().event_handlers


def test_answer_stores_retrieved_nodes_from_its_own_prefill(tiny_engine: KVBoost, hash_embedding) -> None:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4)
    index = VectorStoreIndex(_nodes(), embed_model=hash_embedding)
    warmer = llm.enable_retrieval_warming(idle_seconds=5.0)
    try:
        response = index.as_query_engine(llm=llm, similarity_top_k=2).query("What does the del statement do?")
        texts = [node_prompt_text(n.node) for n in response.source_nodes]
        # Both nodes reached the prompt whole: the answer claimed them and the engine stored
        # them from that prefill; nothing was left for (or waited on) the background worker.
        assert warmer.warmer.claimed_documents == 2 and warmer.warmer.pending == 0
        assert warmer.warmer.warmed_documents == 0
        assert all(tiny_engine.is_document_warm(t) for t in texts)
    finally:
        warmer.detach()


def test_progress_bar_counts_nodes_not_batches(tiny_engine: KVBoost, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvboost_rag.integration.prewarm as prewarm_module

    bars: list[tuple[int, int, str]] = []
    real = prewarm_module.tqdm

    class Recording(real):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            bars.append((self.total, self.n, self.unit))
            super().close()

    monkeypatch.setattr(prewarm_module, "tqdm", Recording)
    nodes = _nodes()
    assert len(nodes) > 3
    KVBoostPrewarmer(engine=tiny_engine, batch_size=3)(nodes, show_progress=True)
    assert set(bars) == {(len(nodes), len(nodes), "node")}  # one bar over the nodes


def test_restarted_app_over_the_same_disk_folder_hits_without_prewarming(tiny_parts, tmp_path) -> None:
    model, tokenizer = tiny_parts
    nodes = _nodes()[:3]
    first = KVBoost.from_model(model, tokenizer, show_progress=False, chunk_size=16, disk_cache_dir=tmp_path)
    KVBoostPrewarmer(llm=KVBoostLLM(engine=first))(nodes)

    restarted = KVBoost.from_model(model, tokenizer, show_progress=False, chunk_size=16, disk_cache_dir=tmp_path)
    texts = [node_prompt_text(node) for node in reversed(nodes)]
    response = KVBoostLLM(engine=restarted, max_new_tokens=2).complete(
        "Context:\n" + "\n\n".join(texts) + "\n\nQuestion: why?\nAnswer:"
    )
    assert response.raw["documents_found"] == 3 and response.raw["content_hit_tokens"] > 0
