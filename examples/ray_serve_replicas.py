"""Serving replicas over a shared Redis Cluster store, with Ray Serve and LangChain.

The recipe for a RAG service that outgrew one machine:

1. a Redis Cluster holds the K/V of the corpus (here: 3 masters started on loopback ports by
   :mod:`kvboost_rag.dev.redis_local`; ``--redis-url`` names a real one);
2. a warm job (``kvboost_rag.warm_job.warm_corpus``, the same as ``kvboost-rag warm``) reads the
   corpus once on Ray workers and stores it there;
3. a Ray Serve deployment with ``--replicas`` replicas, each with its own model and a LangChain
   chain (retriever -> prompt -> ``KVBoostLLM``) whose engine uses the cluster as its Redis tier,
   answers questions. Every replica finds the documents the job warmed: their records are read
   from the cluster when the replica starts, their K/V on the first prompt that holds them.

It prints, per replica, the questions it answered, the document tokens it took from the store
and its Redis hits. Run::

    python examples/ray_serve_replicas.py                # embedded SmolLM2-135M-Instruct
    python examples/ray_serve_replicas.py --tiny         # tiny random model: fast, meaningless text
    python examples/ray_serve_replicas.py --redis-url redis://10.0.0.5:7000/0 --replicas 4

Needs ``pip install 'kvboost-rag[ray,redis]'``, ``integrations/langchain-kvboost`` and, without
``--redis-url``, Debian's redis-server (``bash .ci/install-redis.sh``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections import Counter, defaultdict
from typing import Any

logger = logging.getLogger("ray_serve_replicas")

SYSTEM = "You are a precise assistant for Python programmers. Answer from the reference documents.\n\n"
QUESTIONS = [
    "How does the with statement call __enter__ and __exit__?",
    "What does the yield expression do in a generator?",
    "How are default argument values evaluated?",
    "What does the global statement declare?",
    "How does try/finally interact with return?",
    "What is a lambda expression?",
    "How do comparisons chain in Python?",
    "What does the import statement do?",
]


def corpus(count: int) -> list[str]:
    from kvboost_rag.corpus import python_reference_documents

    return python_reference_documents(max_chars=600)[:count]


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Settings the warm job and every replica share (so they share the cache namespace)."""
    return {"redis_url": args.redis_url, "disk_cache_dir": None, "warm_prefix": SYSTEM, "chunk_size": 64,
            "show_progress": False}


def build_engine(args: argparse.Namespace) -> Any:
    from kvboost_rag import KVBoost

    if args.tiny:
        from kvboost_rag.dev.testing import tiny_engine

        return tiny_engine(**engine_settings(args))
    return KVBoost.from_pretrained(args.model, **engine_settings(args))


def top_k(question: str, docs: list[str], k: int) -> list[str]:
    """Documents sharing the most words with the question (a stand-in for a vector store)."""
    words = set(re.findall(r"[a-z_]{3,}", question.lower()))
    return sorted(docs, key=lambda d: -len(words & set(re.findall(r"[a-z_]{3,}", d.lower()))))[:k]


class RagReplica:
    """One serving replica: its own model, a LangChain chain, the shared cluster store."""

    def __init__(self, args: argparse.Namespace) -> None:
        import os

        from langchain_core.prompts import PromptTemplate
        from langchain_core.runnables import RunnableLambda
        from langchain_kvboost import KVBoostLLM

        self.name = f"replica-{os.getpid()}"
        self.engine = build_engine(args)
        docs = corpus(args.docs)
        prompt = PromptTemplate.from_template(SYSTEM + "{context}\n\nQuestion: {question}\nAnswer:")
        retrieve = RunnableLambda(lambda q: {"context": "\n\n".join(top_k(q, docs, args.top_k)), "question": q})
        self.chain = retrieve | prompt | KVBoostLLM(engine=self.engine, max_new_tokens=args.new_tokens)

    def answer(self, question: str) -> dict[str, Any]:
        before = self.engine.cache_stats()
        text = self.chain.invoke(question)
        after = self.engine.cache_stats()
        return {
            "replica": self.name,
            "answer": text,
            "documents_known": after.documents,
            "content_hit_tokens": after.counters.get("content_hit_tokens", 0) - before.counters.get("content_hit_tokens", 0),
            "redis_hits": after.tiers["redis"]["hits"] - before.tiers["redis"]["hits"],
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="a node of a running Redis Cluster (default: start one on loopback)")
    parser.add_argument("--model", help="local model folder (default: the embedded model)")
    parser.add_argument("--tiny", action="store_true", help="tiny random-weight model")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--warm-workers", type=int, default=2)
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print the per-replica figures as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    import ray
    from ray import serve

    from kvboost_rag.warm_job import EngineSpec, warm_corpus

    cluster = None
    if args.redis_url is None:
        from kvboost_rag.dev.redis_local import start_cluster

        cluster = start_cluster(3)
        args.redis_url = cluster.url
    ray.init(num_cpus=max(args.replicas, args.warm_workers) + 1, include_dashboard=False, log_to_driver=False)
    try:
        settings = engine_settings(args)
        spec = EngineSpec(model=args.model, settings=settings, threads=1,
                          factory="kvboost_rag.dev.testing:tiny_engine" if args.tiny else None)
        report = warm_corpus(corpus(args.docs), spec, workers=args.warm_workers)
        logger.info("warm job: %s", report.summary())

        deployment = serve.deployment(RagReplica, num_replicas=args.replicas, ray_actor_options={"num_cpus": 1})
        handle = serve.run(deployment.bind(args), name="rag", route_prefix=None)
        asked = QUESTIONS * max(1, (4 * args.replicas) // len(QUESTIONS))
        answers = [handle.answer.remote(q) for q in asked]
        results = [a.result() for a in answers]
        per_replica: dict[str, Counter] = defaultdict(Counter)
        for r in results:
            row = per_replica[r["replica"]]
            row["questions"] += 1
            row["content_hit_tokens"] += r["content_hit_tokens"]
            row["redis_hits"] += r["redis_hits"]
            row["documents_known"] = r["documents_known"]
        figures = {"warm_report": report.to_dict(), "replicas": {k: dict(v) for k, v in per_replica.items()}}
        if args.json:
            print(json.dumps(figures))
        else:
            print(f"{'replica':<20}{'questions':>10}{'documents known':>17}{'doc tokens from store':>23}{'redis hits':>12}")
            for name, row in sorted(per_replica.items()):
                print(f"{name:<20}{row['questions']:>10}{row['documents_known']:>17}"
                      f"{row['content_hit_tokens']:>23}{row['redis_hits']:>12}")
        return figures
    finally:
        serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
