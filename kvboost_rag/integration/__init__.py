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

It is the only engine surface the LangChain and LlamaIndex adapters import (besides the public
names of ``kvboost_rag``; ``tests/test_integration_boundary.py`` checks it): the tool-call
format and parsing (:mod:`kvboost_rag.decode.tool_calls`, :mod:`kvboost_rag.decode.react`), the
background warmer (:mod:`kvboost_rag.warming.background`), the engine registry, the drop-in
settings and the thread bridges for async callers are re-exported here.

Nothing here imports a framework (LangChain, LlamaIndex); framework objects (LangChain
``Document``, LlamaIndex nodes and tools) reach it through small converter callables the
adapters pass in.
"""

from kvboost_rag.decode.react import react_call_format
from kvboost_rag.decode.tool_calls import (
    REQUIRED,
    CallFormat,
    ParsedOutput,
    normalize_tool_choice,
    parse_tool_calls,
    render_chat,
    tool_specs,
)
from kvboost_rag.integration.async_stream import call_in_thread, iterate_in_thread
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
from kvboost_rag.warming.background import BackgroundWarmer

__all__ = [
    "CALL_PARAMETERS",
    "REQUIRED",
    "BackgroundWarmer",
    "CallFormat",
    "ParsedOutput",
    "call_in_thread",
    "iterate_in_thread",
    "normalize_tool_choice",
    "parse_tool_calls",
    "react_call_format",
    "render_chat",
    "tool_specs",
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
