"""Warming: beginnings and documents read once, stored for every later prompt."""

from kvboost_rag.warming.documents import (
    CONTEXT_DOCUMENT_SEPARATOR,
    DEFAULT_DOCUMENT_LEAD_IN,
    Warming,
)

__all__ = ["CONTEXT_DOCUMENT_SEPARATOR", "DEFAULT_DOCUMENT_LEAD_IN", "Warming"]
