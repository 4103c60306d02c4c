"""Why a prompt in which no prewarmed document was found missed them, and how to fix it.

Documents are found only where a prompt holds the warmed text character for character. When
documents were prewarmed but a prompt with a long uncached part holds none of them, the usual
causes are a template that renders documents differently from how they were warmed (another
separator, added metadata) or text the framework escaped before it reached the prompt
(LlamaIndex's ``simple_summarize`` formats a Python list of chunks, writing newlines as
``\\n``). :func:`explain_missed_documents` tells the two apart.

When the prompt holds documents that were warmed and then evicted (the corpus outgrew the
cache), :func:`explain_evicted_documents` says so and names the settings that keep them.

Pure: it reads the registry and the prompt text, and computes no K/V.
"""

from __future__ import annotations

from kvboost_rag.request.documents import DocumentRegistry

#: Escapes ``repr`` (and JSON) writes, undone to test whether documents hide behind them.
_ESCAPES = (("\\n", "\n"), ("\\t", "\t"), ("\\'", "'"), ('\\"', '"'), ("\\\\", "\\"))


def unescape(text: str) -> str:
    """``text`` with the escapes of a Python ``repr`` of strings undone (newlines, tabs, quotes)."""
    for escaped, plain in _ESCAPES:
        text = text.replace(escaped, plain)
    return text


def escaped_documents(prompt: str, registry: DocumentRegistry) -> int:
    """How many registered documents appear in ``prompt`` once ``repr`` escapes are undone
    (0 when undoing them changes nothing)."""
    plain = unescape(prompt)
    return len(registry.find(plain)) if plain != prompt else 0


def explain_missed_documents(prompt: str, registry: DocumentRegistry) -> str:
    """The reason no registered document was found in ``prompt``, and the fix.

    Args:
        prompt: The prompt text in which no document was found.
        registry: The engine's registered (prewarmed) documents.

    Returns:
        One sentence for the log: escaped document text when undoing ``repr`` escapes makes
        registered documents appear, else a template mismatch.
    """
    found = escaped_documents(prompt, registry)
    if found:
        return (
            f"{found} prewarmed document(s) appear in it with escaped characters (newlines "
            "written as \\n, as when a list of texts is formatted into the prompt, e.g. "
            "LlamaIndex response_mode='simple_summarize'); put document text in the prompt "
            "as plain text (response_mode='compact' makes the same single call)"
        )
    return (
        "documents are found only where the prompt holds the warmed text exactly; warm each "
        "document as the prompt renders it (same document template and metadata: "
        "KVBoostPrewarmer(document_prompt=...) in LangChain, metadata excluded from the LLM "
        "text in LlamaIndex), or pass the rendered texts as documents=[...]"
    )


def explain_evicted_documents(evicted_total: int, memory_budget: int, has_lower_tier: bool) -> str:
    """The reason a prompt missed documents that were warmed: they were evicted, and the fix.

    Args:
        evicted_total: Documents evicted from the cache so far.
        memory_budget: ``max_cache_bytes``.
        has_lower_tier: Whether a disk or Redis tier is configured (its budget was exceeded too).
    """
    where = (
        "the memory and lower tiers' budgets (max_cache_bytes, max_disk_bytes) were exceeded"
        if has_lower_tier
        else f"the memory tier's budget (max_cache_bytes={memory_budget / 1024**2:.0f} MiB) was exceeded and "
        "no disk or Redis tier kept them"
    )
    return (
        f"{evicted_total} document(s) evicted so far because {where}; keep the corpus with "
        "disk_cache_dir='auto' or a folder, kv_cache_bits=8 (about 4x smaller K/V) or a larger "
        "max_cache_bytes, then warm the documents again"
    )
