"""Integration: the embedded SmolLM2-135M-Instruct behind LlamaIndex query engines.

A VectorStoreIndex over Python reference documents (``pydoc_data.topics``), a deterministic
embedding and the prewarm transform. Prompts are kept short so the module runs in a few
minutes on a 2-core CPU. Each test prints its reuse figures (run with ``-s`` to see them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex, get_response_synthesizer
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.prompts.chat_prompts import (
    CHAT_REFINE_PROMPT,
    CHAT_TEXT_QA_PROMPT,
    TEXT_QA_SYSTEM_PROMPT,
)
from llama_index.core.prompts.prompt_utils import get_biggest_prompt
from llama_index.core.response_synthesizers import refine as refine_module
from llama_index.core.schema import NodeWithScore
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer, node_prompt_text

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_topics

pytestmark = pytest.mark.slow

#: The padding Refine repacks with (llama-index-core 0.14.22 named it; before, repack's default).
REFINE_PADDING = (
    {"padding": refine_module.DEFAULT_RESPONSE_PADDING_SIZE}
    if hasattr(refine_module, "DEFAULT_RESPONSE_PADDING_SIZE")
    else {}
)

TOPICS = ("assert", "break", "del", "global", "raise", "return", "with")
MAX_NEW_TOKENS = 8
RESPONSE_MODES = ("compact", "refine", "tree_summarize", "simple_summarize", "accumulate")


@pytest.fixture(scope="module")
def rag(hash_embedding) -> Iterator[dict[str, Any]]:
    engine = KVBoost.from_pretrained(show_progress=False)
    llm = KVBoostLLM(engine=engine, max_new_tokens=MAX_NEW_TOKENS)
    topics = python_reference_topics()
    documents = [Document(text=topics[name][:500], metadata={"topic": name}) for name in TOPICS]
    prewarm = KVBoostPrewarmer(llm=llm)
    index = VectorStoreIndex.from_documents(
        documents,
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0), prewarm],
        embed_model=hash_embedding,
    )
    yield {"engine": engine, "llm": llm, "index": index, "prewarm": prewarm}


def _system_turn_tokens(engine: KVBoost) -> int:
    turn = engine.apply_chat_template(
        [{"role": "system", "content": TEXT_QA_SYSTEM_PROMPT.content}], add_generation_prompt=False
    )
    return engine.count_tokens(turn)


def _summary(raw: dict[str, Any]) -> str:
    return (
        f"prompt={raw['prompt_tokens']} cached={raw['cached_tokens']} prefix={raw['prefix_hit_tokens']} "
        f"content={raw['content_hit_tokens']} docs={raw['documents_found']} reuse={raw['kv_reuse_ratio']:.2f} "
        f"ttft={raw['ttft_ms']:.0f}ms"
    )


def test_prewarm_at_ingest_warmed_every_node(rag: dict[str, Any]) -> None:
    nodes = list(rag["index"].docstore.docs.values())
    stats = rag["prewarm"].last_stats
    assert stats.nodes == len(nodes) and stats.warmed == len(nodes) and stats.failed == 0
    assert all(rag["engine"].is_document_warm(node_prompt_text(n)) for n in nodes)


def test_second_query_reuses_the_system_prompt_by_prefix_hash(rag: dict[str, Any], recorder) -> None:
    engine = rag["engine"]
    query_engine = rag["index"].as_query_engine(llm=rag["llm"], similarity_top_k=2)
    query_engine.query("What does the assert statement check?")
    query_engine.query("What does the global statement declare?")
    first, second = (call["raw"] for call in recorder.calls[-2:])
    print("\nfirst query: ", _summary(first), "\nsecond query:", _summary(second))
    assert second["prefix_hit_tokens"] >= _system_turn_tokens(engine)
    assert second["content_hit_tokens"] > 0 and second["documents_found"] == 2


def test_retrieved_nodes_in_another_order_hit_by_content_hash(rag: dict[str, Any], recorder) -> None:
    engine = rag["engine"]
    nodes = rag["index"].as_retriever(similarity_top_k=3).retrieve("How does a with statement use context managers?")
    synthesizer = get_response_synthesizer(llm=rag["llm"], response_mode="compact")
    synthesizer.synthesize("How does a with statement use context managers?", nodes=nodes)
    reordered = [NodeWithScore(node=n.node, score=n.score) for n in reversed(nodes)]
    synthesizer.synthesize("How does a with statement use context managers?", nodes=reordered)
    raw = recorder.calls[-1]["raw"]
    print("\nreversed order:", _summary(raw))
    doc_tokens = sum(engine.count_tokens(node_prompt_text(n.node)) for n in nodes)
    assert raw["documents_found"] == 3
    # Every document token is served from cache except those merged across a seam.
    assert raw["content_hit_tokens"] >= doc_tokens - raw["boundary_merged_tokens"] - 3 * 2
    assert raw["prefix_hit_tokens"] >= _system_turn_tokens(engine)


def test_answer_equals_the_engine_output_for_the_same_prompt(rag: dict[str, Any], recorder) -> None:
    engine, llm = rag["engine"], rag["llm"]
    response = rag["index"].as_query_engine(llm=llm, similarity_top_k=2).query("When is a yield expression used?")
    call = recorder.calls[-1]
    prompt = llm.messages_to_prompt(call["messages"])
    direct = engine.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
    assert str(response) == direct.output_text
    assert call["raw"]["usage"]["prompt_tokens"] == direct.prompt_tokens


def test_prefix_reuse_through_the_llm_equals_full_prefill(rag: dict[str, Any]) -> None:
    engine, llm = rag["engine"], rag["llm"]
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content=TEXT_QA_SYSTEM_PROMPT.content),
        ChatMessage(role=MessageRole.USER, content="Name one Python keyword."),
    ]
    reused = llm.chat(messages)
    full = engine.generate(llm.messages_to_prompt(messages), max_new_tokens=MAX_NEW_TOKENS, reuse=False)
    assert reused.raw["prefix_hit_tokens"] >= _system_turn_tokens(engine)
    assert reused.message.content == full.output_text


@pytest.mark.parametrize("mode", RESPONSE_MODES)
def test_each_response_mode_runs_and_reports_reuse(rag: dict[str, Any], recorder, mode: str) -> None:
    query_engine = rag["index"].as_query_engine(llm=rag["llm"], similarity_top_k=2, response_mode=mode)
    recorder.reset()
    response = query_engine.query("What happens when an exception is raised?")
    assert str(response).strip()
    calls = [c["raw"] for c in recorder.calls]
    assert calls, f"{mode} made no LLM call"
    prompt_tokens = sum(r["prompt_tokens"] for r in calls)
    cached = sum(r["cached_tokens"] for r in calls)
    content = sum(r["content_hit_tokens"] for r in calls)
    print(f"\n{mode}: {len(calls)} call(s), reuse {cached / prompt_tokens:.2f}, content-hit tokens {content}")
    for raw in calls:
        print("   ", _summary(raw))
        assert raw["usage"]["prompt_tokens"] == raw["prompt_tokens"] > 0
        assert raw["prefix_hit_tokens"] > 0  # every prompt starts with a warm template turn
    if mode != "simple_summarize":
        # simple_summarize formats the list of truncated chunks into the prompt (its repr,
        # newlines escaped), so node texts do not reach the prompt verbatim.
        assert content > 0


def _window_splitting_in_two(texts: list[str], question: str) -> int:
    """The smallest context window for which compact packs ``texts`` into two prompts."""
    biggest = get_biggest_prompt(
        [CHAT_TEXT_QA_PROMPT.partial_format(query_str=question), CHAT_REFINE_PROMPT.partial_format(query_str=question)]
    )
    for window in range(600, 2000, 10):
        helper = PromptHelper(context_window=window, num_output=MAX_NEW_TOKENS)
        try:
            chunks = helper.repack(biggest, texts, **REFINE_PADDING)
        except ValueError:  # no room left for context at this window
            continue
        if len(chunks) == 2:
            return window
    raise AssertionError("no window splits these texts in two")


def test_compact_resplit_still_hits_documents(rag: dict[str, Any], recorder) -> None:
    engine = rag["engine"]
    question = "What do these statements do?"
    longest = sorted(rag["index"].docstore.docs.values(), key=lambda n: len(node_prompt_text(n)))[-3:]
    nodes = [NodeWithScore(node=n, score=1.0) for n in longest]
    texts = [node_prompt_text(n) for n in longest]
    narrow = KVBoostLLM(
        engine=engine, context_window=_window_splitting_in_two(texts, question), max_new_tokens=MAX_NEW_TOKENS
    )
    recorder.reset()
    get_response_synthesizer(llm=narrow, response_mode="compact").synthesize(question, nodes=nodes)
    calls = recorder.calls
    assert len(calls) == 2, "compact should have re-split the context into two prompts"
    hit_somewhere = 0
    for call in calls:
        prompt = narrow.messages_to_prompt(call["messages"])
        # Nodes present whole, or as a leading part long enough to be anchored.
        expected = sum(1 for t in texts if t in prompt or t[:64] in prompt)
        raw = call["raw"]
        print("\nre-split call:", _summary(raw), f"nodes whole or leading: {expected}")
        assert raw["documents_found"] >= expected
        if expected:
            assert raw["content_hit_tokens"] > 0
        hit_somewhere += expected
    # Every node starts in one of the prompts, bar one cut too close to its start to anchor.
    assert hit_somewhere >= len(texts) - 1


def test_async_query_matches_sync(rag: dict[str, Any]) -> None:
    query_engine = rag["index"].as_query_engine(llm=rag["llm"], similarity_top_k=2)
    question = "What does the del statement remove?"
    expected = str(query_engine.query(question))
    assert str(asyncio.run(query_engine.aquery(question))) == expected
