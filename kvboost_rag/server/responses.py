"""Response bodies in the OpenAI layout, built from the engine's ``GenerationResult``.

Usage is OpenAI's: ``prompt_tokens_details.cached_tokens`` counts the prompt tokens whose
K/V was loaded from the cache and used as loaded (prefix hits and document hits, less the
tokens the repair recomputed). Each choice also carries ``kvboost``: the result's timing and
reuse figures (``ttft_ms``, ``kv_reuse_ratio``, ``documents_found``, ...); a non-streamed
answer with one choice repeats the main ones in ``X-KVBoost-*`` headers.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag import GenerationResult
from kvboost_rag.integration import result_figures, usage
from kvboost_rag.server.internals import CallFormat, ParsedOutput, parse_tool_calls

#: Name of the extension field holding a choice's figures.
FIGURES_FIELD = "kvboost"


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response shares.

    Attributes:
        id: The response id (``chatcmpl-...``, ``cmpl-...``).
        created: Unix time of the request.
        model: The model name the request gave.
        fingerprint: ``system_fingerprint``: the engine's cache namespace, shortened.
    """

    id: str
    created: int
    model: str
    fingerprint: str

    @classmethod
    def new(cls, prefix: str, model: str, fingerprint: str) -> ResponseMeta:
        """A new response's meta, its id ``prefix`` + 24 hex digits."""
        return cls(f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time()), model, fingerprint)

    def envelope(self, kind: str) -> dict[str, Any]:
        """The fields before ``choices``; ``kind`` is the ``object`` field."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}


def openai_usage(results: GenerationResult | Sequence[GenerationResult]) -> dict[str, Any]:
    """``usage`` as OpenAI reports it (``prompt_tokens_details.cached_tokens``)."""
    counts = usage(results)
    counts.pop("cached_tokens", None)  # OpenAI reports it only under prompt_tokens_details
    return counts


def figures(result: GenerationResult) -> dict[str, Any]:
    """The timing and reuse figures of one result."""
    return result_figures(result)


def figure_headers(result: GenerationResult) -> dict[str, str]:
    """The main figures as response headers."""
    return {
        "X-KVBoost-TTFT-Ms": f"{result.ttft_ms:.1f}",
        "X-KVBoost-Cached-Tokens": str(result.cached_tokens),
        "X-KVBoost-Reuse-Ratio": f"{result.kv_reuse_ratio:.4f}",
        "X-KVBoost-Drafted-Tokens": str(result.drafted_tokens),
    }


def finish_reason(result: GenerationResult, constraint: Any = None, parsed: ParsedOutput | None = None) -> str:
    """OpenAI's finish reason.

    ``tool_calls`` for a reply of tool calls that all parse; ``length`` when the budget cut
    the output (a constrained output that closed within the budget, such as JSON that
    parses, is complete: ``stop``); else ``stop`` (a stop string or EOS).
    """
    if parsed is not None and parsed.calls:
        complete = not parsed.invalid_calls
        return "tool_calls" if complete or result.finish_reason != "length" else "length"
    if result.finish_reason != "length":
        return "stop"
    if constraint is not None and constraint.json_schema is not None:
        try:
            json.loads(result.output_text)
        except json.JSONDecodeError:
            return "length"
        return "stop"
    return "length"


def tool_calls(parsed: ParsedOutput, indexed: bool = False) -> list[dict[str, Any]]:
    """The calls of ``parsed`` as OpenAI tool calls; arguments are JSON text (a call that
    could not be read, such as one cut by ``max_tokens``, keeps its raw text). ``indexed``
    adds the ``index`` stream deltas carry."""
    calls = []
    for i, call in enumerate(parsed.calls):
        arguments = json_text(call.arguments) if call.error is None else call.raw
        entry: dict[str, Any] = {"id": call.id, "type": "function",
                                 "function": {"name": call.name or "", "arguments": arguments}}
        calls.append({"index": i, **entry} if indexed else entry)
    return calls


def json_text(value: Any) -> str:
    """Compact JSON text, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def chat_completion(meta: ResponseMeta, result: GenerationResult, fmt: CallFormat) -> dict[str, Any]:
    """A ``chat.completion`` body."""
    message: dict[str, Any] = {"role": "assistant", "content": result.output_text}
    parsed = parse_tool_calls(result.output_text, result.finish_reason) if fmt.parses_tool_calls else None
    if parsed is not None and parsed.calls:
        message = {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls(parsed)}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(result, fmt.constraint, parsed),
              FIGURES_FIELD: figures(result)}
    return {**meta.envelope("chat.completion"), "choices": [choice], "usage": openai_usage(result)}


def chat_chunk(meta: ResponseMeta, delta: dict[str, Any], finish: str | None = None,
               result: GenerationResult | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``; the last one (``finish``) carries the figures."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if result is not None:
        choice[FIGURES_FIELD] = figures(result)
    return {**meta.envelope("chat.completion.chunk"), "choices": [choice]}


def completion_choice(index: int, text: str, finish: str | None, result: GenerationResult | None) -> dict[str, Any]:
    """One choice of a ``text_completion`` body or chunk."""
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    if result is not None:
        choice[FIGURES_FIELD] = figures(result)
    return choice


def completion(meta: ResponseMeta, results: Sequence[GenerationResult], constraint: Any = None) -> dict[str, Any]:
    """A ``text_completion`` body, one choice per prompt (``constraint``: the output's)."""
    choices = [completion_choice(i, r.output_text, finish_reason(r, constraint), r) for i, r in enumerate(results)]
    return {**meta.envelope("text_completion"), "choices": choices, "usage": openai_usage(results)}


def usage_chunk(meta: ResponseMeta, kind: str, result: GenerationResult) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage."""
    return {**meta.envelope(kind), "choices": [], "usage": openai_usage(result)}
