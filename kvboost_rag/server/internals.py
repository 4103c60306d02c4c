"""The server's only imports from below the engine's public surface.

Everything else in :mod:`kvboost_rag.server` uses the public package (``KVBoost``, its
settings, results and errors) and :mod:`kvboost_rag.integration`. When the engine's modules
move, this file is the one to change.
"""

from __future__ import annotations

from kvboost_rag.decode.tool_calls import (
    CallFormat,
    ParsedOutput,
    parse_tool_calls,
    render_chat,
)
from kvboost_rag.integration.async_stream import call_in_thread, iterate_in_thread
from kvboost_rag.warm_job.report import DocumentFailure, WarmReport
from kvboost_rag.warm_job.sources import SourceDocument, read_source
from kvboost_rag.warm_job.worker import EngineSpec

__all__ = [
    "CallFormat",
    "DocumentFailure",
    "EngineSpec",
    "ParsedOutput",
    "SourceDocument",
    "WarmReport",
    "call_in_thread",
    "iterate_in_thread",
    "parse_tool_calls",
    "read_source",
    "render_chat",
]
