"""Warming a corpus into the shared store: in one process, or over Ray workers.

``warm_corpus`` (Python) and ``kvboost-rag warm`` (command line) read a folder of text files,
a JSONL file or a LangChain/LlamaIndex document store, and warm every document into the store
the settings name (Redis, a Redis Cluster, or a disk folder), skipping documents stored
already, so a killed job resumes. Serving replicas over the same store then find them.
"""

from kvboost_rag.warm_job.report import BatchOutcome, DocumentFailure, WarmReport
from kvboost_rag.warm_job.runner import warm_corpus
from kvboost_rag.warm_job.sources import SourceDocument, read_source
from kvboost_rag.warm_job.worker import EngineSpec, WarmWorker

__all__ = [
    "BatchOutcome",
    "DocumentFailure",
    "EngineSpec",
    "SourceDocument",
    "WarmReport",
    "WarmWorker",
    "read_source",
    "warm_corpus",
]
