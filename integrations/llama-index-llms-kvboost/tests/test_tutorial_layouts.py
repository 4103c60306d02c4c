"""The query and chat engines LlamaIndex's tutorials use, after prewarm at ingest.

Each layout must take most of its document tokens from cache (by content hash, wherever the
nodes land: user turn, refine prompt, or system turn as the chat engines put them) and must
not grow memory per query beyond the non-document text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.llms import ChatMessage
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer
from llama_index.llms.kvboost.formatting import node_prompt_text

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_documents

QUESTIONS = (
    "What does the assert statement check?",
    "How does the for statement loop?",
    "What does the while statement do?",
)
#: Share of the document tokens of the layout's prompts that must come from cache.
MIN_DOCUMENT_HIT_SHARE = 0.8
TOP_K = 3


def _bytes_per_token(engine: KVBoost) -> int:
    config = engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(engine.model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def _prompt_text(call: dict[str, Any]) -> str:
    if call["kind"] == "chat":
        return "\n".join(str(m.content or "") for m in call["messages"] if isinstance(m, ChatMessage))
    return str(call["prompt"])


@pytest.fixture
def index_and_llm(tiny_engine: KVBoost, hash_embedding: Any) -> tuple[VectorStoreIndex, KVBoostLLM, list[str]]:
    llm = KVBoostLLM(engine=tiny_engine, max_new_tokens=4)
    documents = [Document(text=t) for t in python_reference_documents(max_chars=300)[:16]]
    index = VectorStoreIndex.from_documents(
        documents, transformations=[KVBoostPrewarmer(llm=llm)], embed_model=hash_embedding
    )
    texts = [node_prompt_text(n) for n in index.docstore.docs.values()]
    assert all(tiny_engine.is_document_warm(t) for t in texts)
    return index, llm, texts


def _check_layout(llm: KVBoostLLM, texts: list[str], recorder: Any, ask: Callable[[str], Any]) -> None:
    engine = llm.engine
    per_token = _bytes_per_token(engine)
    before = engine.cache_stats().memory_bytes
    non_document_tokens = 0
    for question in QUESTIONS:
        recorder.reset()
        ask(question)
        assert recorder.calls, "the layout made no LLM call"
        document_tokens = hits = 0
        for call in recorder.calls:
            raw, prompt = call["raw"], _prompt_text(call)
            present = [t for t in texts if t in prompt]
            tokens = sum(engine.count_tokens(t) for t in present)
            document_tokens += tokens
            hits += raw["content_hit_tokens"]
            # the retrieved nodes, and blocks of the template's own text stored by an earlier call
            assert raw["documents_found"] >= len(present)
            assert raw["cached_tokens"] == raw["prefix_hit_tokens"] + raw["content_hit_tokens"] - raw["recomputed_tokens"] < raw["prompt_tokens"]
            non_document_tokens += max(0, raw["prompt_tokens"] - tokens)
        assert document_tokens > 0, "no retrieved node reached a prompt"
        assert hits >= MIN_DOCUMENT_HIT_SHARE * document_tokens
        grown = engine.cache_stats().memory_bytes - before
        assert grown <= per_token * non_document_tokens, "memory grew beyond the non-document text"


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize"])
def test_query_engine_response_modes(index_and_llm: Any, recorder: Any, mode: str) -> None:
    index, llm, texts = index_and_llm
    engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K, response_mode=mode)
    _check_layout(llm, texts, recorder, engine.query)


@pytest.mark.parametrize("chat_mode", ["condense_plus_context", "context"])
def test_chat_engines_with_context_in_the_system_turn(index_and_llm: Any, recorder: Any, chat_mode: str) -> None:
    index, llm, texts = index_and_llm
    engine = index.as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=TOP_K)
    _check_layout(llm, texts, recorder, engine.chat)


def test_simple_summarize_escapes_nodes_and_the_warning_says_so(
    index_and_llm: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    import kvboost_rag.generation.completion as engine_module
    from kvboost_rag.log_limits import RateLimitedLogger

    monkeypatch.setattr(engine_module, "_warnings", RateLimitedLogger(engine_module.logger))
    index, llm, _ = index_and_llm
    engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K, response_mode="simple_summarize")
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        engine.query(QUESTIONS[0])
    (message,) = [r.getMessage() for r in caplog.records if "none was found" in r.getMessage()]
    assert "escaped" in message and "compact" in message
