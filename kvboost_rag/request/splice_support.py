"""Whether a tokenizer's output over a prompt may be assembled from pieces tokenized apart.

Splicing stored document tokens into a prompt (:mod:`kvboost_rag.request.splicing`) rests on
one property of the tokenizer: its output near a character depends only on the text near
that character. That holds for the pipelines listed here and is what the splice's window
checks measure; anything else (a missing or unknown pre-tokenizer, a pre-tokenizer that never
splits on whitespace so one "word" spans the whole text, BPE dropout, a normalizer outside the
list) is tokenized whole, as before.

- normalizers: none, the Unicode forms (NFC, NFD, NFKC, NFKD), ``Lowercase``, ``Strip``,
  ``Prepend``, ``Replace`` of a literal string, and sequences of these;
- pre-tokenizers: ``ByteLevel``, ``Split`` (a literal or a regular expression without
  look-behind), ``Metaspace``, ``Whitespace``, ``WhitespaceSplit``, ``BertPreTokenizer``,
  ``Digits``, ``Punctuation``, and sequences of these with at least one that splits words
  at whitespace;
- models: BPE without dropout, Unigram, WordPiece, WordLevel (each tokenizes one word at a
  time, the same wherever the word stands).

The special tokens the post-processor adds around a prompt (a BOS, an EOS) are read from a
probe, and the engine's call is checked to give the backend's own output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Normalizers that change characters one at a time (or prepend to a piece).
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "Prepend", "Replace", "Sequence"}
#: Pre-tokenizers that split words at whitespace on their own.
_WORD_SPLITTERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
#: Pre-tokenizers that only split further.
_FURTHER_SPLITTERS = {"Digits", "Punctuation"}
_MODELS = {"BPE", "Unigram", "WordPiece", "WordLevel"}
#: Regular-expression parts that look behind the match start: such a pattern is not local.
_LOOK_BEHIND = ("(?<=", "(?<!", "\\b", "\\B", "\\G", "\\A")
_PROBE = "Probe text: one two."


@dataclass(frozen=True)
class SpliceSupport:
    """What splicing needs to know about one tokenizer.

    Attributes:
        backend: The ``tokenizers.Tokenizer`` behind the fast tokenizer.
        prefix_ids: Special tokens the post-processor puts before a prompt.
        prefix_spans: Their character spans.
        suffix_ids: Special tokens it puts after.
        suffix_spans: Their character spans.
    """

    backend: Any
    prefix_ids: tuple[int, ...]
    prefix_spans: tuple[tuple[int, int], ...]
    suffix_ids: tuple[int, ...]
    suffix_spans: tuple[tuple[int, int], ...]


def splice_support(tokenizer: Any) -> tuple[SpliceSupport | None, str]:
    """``(support, reason)``: how to splice this tokenizer's output, or ``None`` and why not."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None, "not a fast tokenizer"
    reason = _pipeline_problem(backend)
    if reason:
        return None, reason
    full = backend.encode(_PROBE, add_special_tokens=True)
    bare = backend.encode(_PROBE, add_special_tokens=False)
    through = tokenizer(_PROBE, add_special_tokens=True, return_offsets_mapping=True)
    if list(through["input_ids"]) != full.ids or [tuple(o) for o in through["offset_mapping"]] != full.offsets:
        return None, "the tokenizer's call differs from its backend's encoding"
    n = len(bare.ids)
    at = next((i for i in range(len(full.ids) - n + 1) if full.ids[i : i + n] == bare.ids), None)
    if at is None or full.offsets[at : at + n] != bare.offsets:
        return None, "the post-processor changes the prompt's own tokens"
    support = SpliceSupport(
        backend=backend,
        prefix_ids=tuple(full.ids[:at]),
        prefix_spans=tuple(full.offsets[:at]),
        suffix_ids=tuple(full.ids[at + n :]),
        suffix_spans=tuple(full.offsets[at + n :]),
    )
    return support, ""


def _pipeline_problem(backend: Any) -> str:
    """Why the backend's pipeline is not one splicing supports ("" when it is)."""
    model = type(backend.model).__name__
    if model not in _MODELS:
        return f"model {model} is not one that tokenizes word by word"
    if getattr(backend.model, "dropout", None):
        return "BPE dropout makes tokenizing random"
    normalizer = _state(backend.normalizer)
    if normalizer is not None and not _normalizer_ok(normalizer):
        return f"normalizer {normalizer.get('type')} is not known to work character by character"
    pre = _state(backend.pre_tokenizer)
    if pre is None:
        return "no pre-tokenizer: the whole text is one word"
    known, splits = _pre_tokenizer_ok(pre)
    if not known:
        return f"pre-tokenizer {pre.get('type')} is not one splicing knows"
    if not splits:
        return "the pre-tokenizer never splits words at whitespace"
    return ""


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_ok(state: dict[str, Any]) -> bool:
    kind = state.get("type")
    if kind == "Sequence":
        return all(_normalizer_ok(child) for child in state.get("normalizers", []))
    if kind == "Replace":
        return "String" in state.get("pattern", {})
    return kind in _NORMALIZERS


def _pre_tokenizer_ok(state: dict[str, Any]) -> tuple[bool, bool]:
    """``(known, splits words at whitespace)``."""
    kind = state.get("type")
    if kind == "Sequence":
        parts = [_pre_tokenizer_ok(child) for child in state.get("pretokenizers", [])]
        return all(known for known, _ in parts), any(splits for _, splits in parts)
    if kind == "ByteLevel":
        return True, bool(state.get("use_regex", True))
    if kind == "Metaspace":
        return True, bool(state.get("split", True))
    if kind == "Split":
        pattern = state.get("pattern", {})
        regex = pattern.get("Regex", "")
        return not any(part in regex for part in _LOOK_BEHIND), True
    if kind in _WORD_SPLITTERS:
        return True, True
    return kind in _FURTHER_SPLITTERS, False
