"""RAG demo on the embedded model and the Python reference docs.

Run ``python -m kvboost_rag.demo`` (or ``kvboost-rag-demo``). It answers a few questions
over retrieved reference documents three ways and prints time to first token (TTFT) and
reuse for each: a cold query (nothing cached yet), the same questions after the corpus was
prewarmed (documents come back in new orders and hit by content hash), and full prefill of
the same prompts for comparison.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import time
from collections import Counter

import torch

from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.engine import KVBoost

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a helpful assistant for Python programmers. Answer the question in one or two "
    "sentences using only the reference documents below."
)
COLD_QUESTION = "What does the assert statement do when the expression is false?"
QUESTIONS = [
    "How does a for statement iterate over a sequence?",
    "What does the pass statement do?",
    "How are exceptions raised with the raise statement?",
]
_WORD = re.compile(r"[a-z_]+")


class KeywordRetriever:
    """Ranks documents by TF-IDF overlap with the question (enough for a demo corpus)."""

    def __init__(self, documents: list[str]) -> None:
        self.documents = documents
        self._counts = [Counter(_WORD.findall(d.lower())) for d in documents]
        frequency = Counter(word for counts in self._counts for word in counts)
        self._idf = {w: math.log(len(documents) / f) for w, f in frequency.items()}

    def top(self, question: str, k: int) -> list[str]:
        """The ``k`` best documents for ``question``, best first."""
        words = set(_WORD.findall(question.lower()))
        scores = [
            sum(self._idf.get(w, 0.0) * math.log1p(counts[w]) for w in words) for counts in self._counts
        ]
        order = sorted(range(len(self.documents)), key=lambda i: -scores[i])
        return [self.documents[i] for i in order[:k]]


def build_prompt(question: str, documents: list[str]) -> str:
    """Chat-formatted RAG prompt: system prompt, documents, question."""
    context = "\n\n".join(documents)
    return f"{SYSTEM_PROMPT}\n\n{context}\n\nQuestion: {question}\nAnswer:"


def main(argv: list[str] | None = None) -> None:
    """Run the demo and print a table of TTFT and reuse."""
    parser = argparse.ArgumentParser(description="kvboost-rag demo on the embedded model")
    parser.add_argument("--docs", type=int, default=16, help="corpus size (reference topics)")
    parser.add_argument("--top-k", type=int, default=4, help="documents per prompt")
    parser.add_argument("--doc-chars", type=int, default=1200, help="characters per document")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    corpus = python_reference_documents(max_chars=args.doc_chars)[: args.docs]
    retriever = KeywordRetriever(corpus)
    engine = KVBoost.from_pretrained(warm_prefix=SYSTEM_PROMPT + "\n\n")
    print(f"model: {engine.model_name}  corpus: {len(corpus)} Python reference documents  threads: {torch.get_num_threads()}")

    cold_prompt = build_prompt(COLD_QUESTION, retriever.top(COLD_QUESTION, args.top_k))
    cold = engine.generate(cold_prompt, max_new_tokens=args.new_tokens)

    start = time.perf_counter()
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(corpus)
    print(f"prewarmed {len(corpus)} documents in {time.perf_counter() - start:.1f}s (done once, at ingest)\n")

    print("| query | prompt tokens | TTFT full prefill ms | TTFT kvboost ms | speedup | reused | answer |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print(
        f"| cold (nothing cached): {COLD_QUESTION[:30]} | {cold.prompt_tokens} | - | {cold.ttft_ms:.0f} | - | "
        f"{cold.kv_reuse_ratio:.0%} | {cold.output_text.strip()[:60]!r} |"
    )
    rows = [(q, build_prompt(q, retriever.top(q, args.top_k))) for q in QUESTIONS]
    rows.append((f"repeat: {COLD_QUESTION}", cold_prompt))
    for question, prompt in rows:
        full = engine.generate(prompt, max_new_tokens=args.new_tokens, reuse=False)
        fast = engine.generate(prompt, max_new_tokens=args.new_tokens)
        print(
            f"| {question[:46]} | {fast.prompt_tokens} | {full.ttft_ms:.0f} | {fast.ttft_ms:.0f} | "
            f"{full.ttft_ms / fast.ttft_ms:.1f}x | {fast.kv_reuse_ratio:.0%} | {fast.output_text.strip()[:60]!r} |"
        )
    stats = engine.cache_stats()
    print(f"\ncache: {stats.entries} entries, {stats.memory_bytes / 2**20:.0f} MiB in memory, {stats.documents} documents registered")


if __name__ == "__main__":
    main()
