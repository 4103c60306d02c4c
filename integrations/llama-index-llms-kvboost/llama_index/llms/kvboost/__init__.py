"""LlamaIndex integration of kvboost-rag: an LLM that reuses K/V, and prewarm at ingest."""

from llama_index.llms.kvboost.base import KVBoostLLM
from llama_index.llms.kvboost.formatting import node_prompt_text
from llama_index.llms.kvboost.prewarm import KVBoostPrewarm, PrewarmStats
from llama_index.llms.kvboost.retrieval import KVBoostRetrievalWarmer

from kvboost_rag.background_warmer import BackgroundWarmer

__all__ = [
    "BackgroundWarmer",
    "KVBoostLLM",
    "KVBoostPrewarm",
    "KVBoostRetrievalWarmer",
    "PrewarmStats",
    "node_prompt_text",
]
