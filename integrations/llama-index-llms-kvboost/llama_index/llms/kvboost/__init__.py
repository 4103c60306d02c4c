"""LlamaIndex integration of kvboost-rag: an LLM that reuses K/V, and prewarm at ingest.

- :class:`KVBoostLLM`: the LLM (replaces ``HuggingFaceLLM``).
- :class:`KVBoostPrewarmer`: ingest transform that warms every node.
- :class:`KVBoostRetrievalWarmer`: warms retrieved nodes that were never prewarmed.

The names are the ones the LangChain integration uses for the same parts
(``KVBoostPrewarmer``, ``KVBoostRetrievalWarmer``, ``engine_settings``).
"""

from llama_index.llms.kvboost.base import KVBoostLLM
from llama_index.llms.kvboost.formatting import node_prompt_text
from llama_index.llms.kvboost.prewarm import KVBoostPrewarmer, PrewarmStats
from llama_index.llms.kvboost.retrieval import KVBoostRetrievalWarmer

from kvboost_rag.integration import BackgroundWarmer

__all__ = [
    "BackgroundWarmer",
    "KVBoostLLM",
    "KVBoostPrewarmer",
    "KVBoostRetrievalWarmer",
    "PrewarmStats",
    "node_prompt_text",
]
