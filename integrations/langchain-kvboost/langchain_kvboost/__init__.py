"""LangChain integration of kvboost-rag: RAG answers that reuse cached K/V.

- :class:`KVBoostLLM`: text-completion LLM (replaces ``HuggingFacePipeline``).
- :class:`ChatKVBoost`: chat model (replaces ``ChatHuggingFace``).
- :class:`KVBoostPrewarmer` / :class:`PrewarmingVectorStore`: warm documents at ingest.
- :class:`KVBoostRetrievalWarmer`: warm retrieved documents after each answer.

The names are the ones the LlamaIndex integration uses for the same parts
(``KVBoostPrewarmer``, ``KVBoostRetrievalWarmer``, ``engine_settings``).

Importing this package is light; torch and transformers load with the first engine.
"""

from importlib import metadata

from langchain_kvboost._common import DOCUMENTS_METADATA_KEY
from langchain_kvboost.callbacks import KVBoostRetrievalWarmer
from langchain_kvboost.chat_models import ChatKVBoost
from langchain_kvboost.llms import KVBoostLLM
from langchain_kvboost.prewarm import KVBoostPrewarmer, PrewarmingVectorStore

try:
    __version__ = metadata.version("langchain-kvboost")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "DOCUMENTS_METADATA_KEY",
    "ChatKVBoost",
    "KVBoostLLM",
    "KVBoostPrewarmer",
    "KVBoostRetrievalWarmer",
    "PrewarmingVectorStore",
    "__version__",
]
