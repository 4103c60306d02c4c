"""Constrained decoding: output that matches a JSON schema or a grammar by construction.

An :class:`OutputConstraint` (a field of ``GenerationOptions``) names what the decoded text
must be: a JSON schema or a Lark grammar in llguidance's dialect (which embeds JSON schemas
with ``%json { ... }``). :class:`ConstraintCompiler` turns it into a :class:`GrammarGuide`,
one per generated sequence, which the sampling hook
(:func:`kvboost_rag.sampling.next_token`) asks to mask each step's logits and tells which
token was chosen. Prefill and K/V reuse are untouched: only the choice of each new token is.

The matching is done by `llguidance <https://github.com/guidance-ai/llguidance>`_ (the
optional extra ``kvboost-rag[constrained]``): of xgrammar, outlines-core and llguidance it had
the lowest schema compile time and a steady per-token mask time (about 0.2% of a decode step
of the embedded model) on CPU with the embedded tokenizer (``bench/constraint_bench.py``), its
Lark grammars embed JSON schemas, and it installs with no dependencies.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from kvboost_rag.errors import InvalidInputError

logger = logging.getLogger(__name__)

#: JSON layout every JSON schema is compiled with unless the schema's own ``x-guidance`` says
#: otherwise: one space after ``:`` and ``,`` (what models read in their training data), and
#: no free whitespace, so a weak model cannot spend its token budget on blanks.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

_INSTALL_HINT = "constrained decoding needs llguidance: pip install 'kvboost-rag[constrained]'"


_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def masked_by_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` with every token whose bit is clear in ``bitmask`` set to ``-inf``.

    Eager torch operations on purpose: ``llguidance.torch.apply_token_bitmask_inplace`` is a
    ``torch.compile`` kernel, which needs a C++ compiler at run time and fails to build when
    torch's CPU kernels are capped (``ATEN_CPU_CAPABILITY=default``).

    Args:
        logits: ``[vocab]`` logits of one sequence, on any device.
        bitmask: ``[ceil(vocab / 32)]`` int32 words; bit ``i % 32`` of word ``i // 32`` is set
            when token ``i`` is allowed (llguidance's layout). Tokens beyond the mask are forbidden.

    Returns:
        The masked copy, same dtype and device as ``logits``.
    """
    words = bitmask.to(logits.device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> _BIT_POSITIONS.to(logits.device)) & 1
    allowed = bits.reshape(-1).bool()
    vocab = logits.shape[-1]
    if allowed.numel() < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
    return logits.masked_fill(~allowed[:vocab], float("-inf"))


class OutputConstraint(BaseModel):
    """What the generated text must match. Set exactly one field.

    Attributes:
        json_schema: A JSON schema (a dict); the output is one JSON value valid for it.
        grammar: A Lark grammar in llguidance's dialect; ``%json { schema }`` embeds a JSON
            schema as a rule.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    @field_validator("json_schema")
    @classmethod
    def _serializable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                json.dumps(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema must be JSON-serializable: {exc}") from None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> OutputConstraint:
        if (self.json_schema is None) == (self.grammar is None):
            raise ValueError("set exactly one of json_schema and grammar")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar is empty")
        return self

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any]) -> OutputConstraint:
        """A constraint to one JSON value valid for ``schema``."""
        return cls(json_schema=dict(schema))

    @classmethod
    def any_json_object(cls) -> OutputConstraint:
        """A constraint to one JSON object of any shape (JSON mode)."""
        return cls(json_schema={"type": "object"})

    def llguidance_grammar(self) -> str:
        """This constraint as an llguidance grammar string."""
        import llguidance

        if self.json_schema is not None:
            schema = dict(self.json_schema)
            schema["x-guidance"] = {**JSON_LAYOUT, **schema.get("x-guidance", {})}
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        assert self.grammar is not None
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class GrammarGuide:
    """The matcher of one sequence: masks logits to the tokens the grammar allows next.

    Args:
        matcher: An ``llguidance.LLMatcher`` at the start of the output.
        vocab_size: Width of the logits rows it masks.
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch

        self._matcher = matcher
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the ``[vocab]`` logits with every token the grammar forbids next set to
        ``-inf`` (llguidance fills its bitmask, :func:`masked_by_bitmask` applies it).

        Raises:
            RuntimeError: The matcher is in an error state (a token it forbade was consumed).
        """
        import llguidance.torch

        if self._matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask)
        return masked_by_bitmask(logits, self._bitmask[0])

    def advance(self, token: int) -> None:
        """Move past the chosen ``token`` (the end-of-sequence token included)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole match (the output may end here)."""
        return bool(self._matcher.is_accepting())


class ConstraintCompiler:
    """Compiles :class:`OutputConstraint` objects for one tokenizer.

    The tokenizer's llguidance view is built on first use (about 0.3 s for a 49k vocabulary)
    and kept.

    Args:
        tokenizer: The model's fast HuggingFace tokenizer.
        vocab_size: Width of the model's logits.
        eos_ids: Token ids that end a sequence.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(set(eos_ids))
        self._view: Any = None
        self._lock = threading.Lock()

    def _tokenizer_view(self) -> Any:
        with self._lock:
            if self._view is None:
                import llguidance.hf

                self._view = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids or None
                )
            return self._view

    def compile(self, constraint: OutputConstraint) -> GrammarGuide:
        """A fresh guide for one sequence.

        Raises:
            InvalidInputError: llguidance is not installed, or the schema or grammar is
                invalid (the message quotes the reason).
        """
        try:
            import llguidance
        except ImportError:
            raise InvalidInputError(_INSTALL_HINT) from None
        try:
            grammar = constraint.llguidance_grammar()
        except ValueError as exc:
            raise InvalidInputError(f"invalid output constraint: {exc}") from None
        view = self._tokenizer_view()
        matcher = llguidance.LLMatcher(view, grammar, log_level=0)
        if matcher.is_error():
            what = "JSON schema" if constraint.json_schema is not None else "grammar"
            raise InvalidInputError(
                f"invalid {what} for constrained decoding: {matcher.get_error()}; fix the {what} "
                "(JSON schemas: draft 2020-12 keywords, local $refs only)"
            )
        return GrammarGuide(matcher, self._vocab_size)
