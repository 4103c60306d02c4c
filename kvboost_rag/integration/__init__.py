"""The framework-free core both framework integrations are thin adapters over.

- :mod:`~kvboost_rag.integration.params`: per-call parameters, one set of names and aliases
  (``documents``, ``max_new_tokens``/``max_tokens``, ``stop``, ...), turned into the keyword
  arguments of ``KVBoost.generate`` / ``KVBoost.stream``.
- :mod:`~kvboost_rag.integration.usage`: the token usage and the reuse and timing figures of
  a ``GenerationResult``, as plain dicts.
- :mod:`~kvboost_rag.integration.tool_arguments`: a call's tool and output-format keywords
  to a :class:`~kvboost_rag.decode.tool_calls.CallFormat`.
- :mod:`~kvboost_rag.integration.tool_stream`: which streamed pieces are shown as text and
  which are held back as a tool call.
- :mod:`~kvboost_rag.integration.prewarm`: warming many documents at once, skipping
  already-warm and oversized ones, in batches, with each failing document isolated.

Nothing here imports a framework (LangChain, LlamaIndex); framework objects (LangChain
``Document``, LlamaIndex nodes and tools) reach it through small converter callables the
adapters pass in.
"""

from kvboost_rag.integration.params import (
    CALL_PARAMETERS,
    UnknownParameterError,
    call_params,
    resolve_aliases,
)
from kvboost_rag.integration.prewarm import (
    PrewarmStats,
    default_max_document_tokens,
    prewarm_texts,
    texts_to_warm,
)
from kvboost_rag.integration.tool_arguments import TOOL_PARAMETERS, pop_call_format
from kvboost_rag.integration.tool_stream import ToolCallHoldBack
from kvboost_rag.integration.usage import RESULT_FIGURES, result_figures, usage

__all__ = [
    "CALL_PARAMETERS",
    "RESULT_FIGURES",
    "TOOL_PARAMETERS",
    "PrewarmStats",
    "ToolCallHoldBack",
    "UnknownParameterError",
    "call_params",
    "default_max_document_tokens",
    "pop_call_format",
    "prewarm_texts",
    "resolve_aliases",
    "result_figures",
    "texts_to_warm",
    "usage",
]
