"""Token usage and the reuse and timing figures of generation results, as plain dicts.

One builder serves every place that reports usage: LangChain's ``llm_output["token_usage"]``
and ``usage_metadata``, LlamaIndex's ``raw["usage"]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvboost_rag.results import GenerationResult

#: Fields of ``GenerationResult`` that are figures of the call (not its text, ids or logits).
RESULT_FIGURES = (
    "finish_reason",
    "ttft_ms",
    "total_ms",
    "prompt_tokens",
    "generated_tokens",
    "drafted_tokens",
    "draft_steps",
    "decode_steps",
    "cached_tokens",
    "prefix_hit_tokens",
    "content_hit_tokens",
    "recomputed_tokens",
    "recompute_ratio",
    "live_tokens",
    "boundary_merged_tokens",
    "documents_found",
    "kv_reuse_ratio",
    "loaded_kv_bytes",
    "strategy",
)

#: Fields of ``GenerationResult`` that are no figures.
_NOT_FIGURES = frozenset({"output_text", "token_ids", "first_token_logits", "step_logits"})


def result_figures(result: GenerationResult) -> dict[str, Any]:
    """The timing and reuse figures of one result (every field but the text, ids and logits).

    Args:
        result: The engine's ``GenerationResult``.

    Returns:
        At least the fields of :data:`RESULT_FIGURES`.
    """
    dump = getattr(result, "model_dump", None)
    if callable(dump):
        return dict(dump(exclude=set(_NOT_FIGURES)))
    return {name: getattr(result, name) for name in RESULT_FIGURES}


def usage(results: GenerationResult | Iterable[GenerationResult]) -> dict[str, Any]:
    """Token usage of one result or the sum over several, in the OpenAI layout.

    Args:
        results: One ``GenerationResult``, or several (a batch).

    Returns:
        ``prompt_tokens``, ``completion_tokens``, ``total_tokens``, ``cached_tokens`` (prompt
        tokens whose K/V was loaded from the cache) and ``prompt_tokens_details``
        (``{"cached_tokens": ...}``).
    """
    items = [results] if hasattr(results, "prompt_tokens") else list(results)  # type: ignore[arg-type]
    prompt = sum(int(r.prompt_tokens) for r in items)
    completion = sum(int(r.generated_tokens) for r in items)
    cached = sum(int(r.cached_tokens) for r in items)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cached_tokens": cached,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
