"""Constrained decoding: output that matches a JSON schema or a grammar by construction.

An :class:`OutputConstraint` (a field of ``GenerationOptions``) names what the decoded text
must be: a JSON schema or a Lark grammar in llguidance's dialect (which embeds JSON schemas
with ``%json { ... }``). :class:`ConstraintCompiler` turns it into a :class:`GrammarGuide`,
one per generated sequence, which the sampling hook
(:func:`kvboost_rag.decode.sampling.next_token`) asks to mask each step's logits and tells which
token was chosen. Prefill and K/V reuse are untouched: only the choice of each new token is.

A guide compiled for a token budget also closes the output within it: it keeps a closing path
(:mod:`kvboost_rag.decode.closing`) of its current state and refuses a token after which closing takes
more tokens than are left, so the output always completes the grammar. A budget below the
constraint's minimum (the closing path of the empty output) is refused before decoding.

The matching is done by `llguidance <https://github.com/guidance-ai/llguidance>`_ (the
optional extra ``kvboost-rag[constrained]``): of xgrammar, outlines-core and llguidance it had
the lowest schema compile time and a steady per-token mask time (about 0.2% of a decode step
of the embedded model) on CPU with the embedded tokenizer (``bench/constraint_bench.py``), its
Lark grammars embed JSON schemas, and it installs with no dependencies.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterable
from typing import Any

import torch

from kvboost_rag.decode.closing import ClosingPlanner
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.request.constraint import OutputConstraint

logger = logging.getLogger(__name__)

#: JSON layout every JSON schema is compiled with unless the schema's own ``x-guidance`` says
#: otherwise: one space after ``:`` and ``,`` (what models read in their training data), and
#: no free whitespace, so a weak model cannot spend its token budget on blanks.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

_INSTALL_HINT = "constrained decoding needs llguidance: pip install 'kvboost-rag[constrained]'"


def llguidance_grammar(constraint: OutputConstraint) -> str:
    """``constraint`` as an llguidance grammar string (JSON schemas laid out as
    :data:`JSON_LAYOUT` unless their ``x-guidance`` says otherwise)."""
    import llguidance

    if constraint.json_schema is not None:
        schema = dict(constraint.json_schema)
        schema["x-guidance"] = {**JSON_LAYOUT, **schema.get("x-guidance", {})}
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert constraint.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)


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


class GrammarGuide:
    """The matcher of one sequence: masks logits to the tokens the grammar allows next and,
    given a budget, keeps the output closable within it.

    Args:
        matcher: An ``llguidance.LLMatcher`` at the start of the output.
        vocab_size: Width of the logits rows it masks.
        planner: Finds closing paths (``None``: no closing).
        budget: Most tokens the output may take, end-of-sequence excluded (``None``: no
            closing).
        eos_ids: Tokens that end the sequence (they cost no budget).
    """

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        planner: ClosingPlanner | None = None,
        budget: int | None = None,
        eos_ids: Iterable[int] = (),
    ) -> None:
        import llguidance.torch

        self._matcher = matcher
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._eos_ids = frozenset(eos_ids)
        self._planner = planner if budget is not None else None
        self._left = budget
        #: Tokens that finish the output from the current state (``None``: not closing).
        self._path = self._planner.path(matcher) if self._planner is not None else None

    @property
    def minimum_tokens(self) -> int | None:
        """Tokens the closing path of the current state takes (at the start: the fewest
        tokens a valid output takes), or ``None`` when the guide does not close."""
        return None if self._path is None else len(self._path)

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

    def advance(self, token: int) -> bool:
        """Move past the chosen ``token`` (the end-of-sequence token included).

        Returns:
            ``False``, with nothing changed, when the guide closes and after ``token`` the
            output could no longer be completed within the tokens left (take another token,
            or :meth:`closing_token`); else ``True``.

        Raises:
            RuntimeError: ``token`` is one the grammar forbids.
        """
        path = self._path
        if path is None or token in self._eos_ids:
            self._consume(token)
            return True
        assert self._left is not None and self._planner is not None
        if path and token == path[0]:
            self._consume(token)
            self._path, self._left = path[1:], self._left - 1
            return True
        self._consume(token)
        after = self._planner.path(self._matcher)
        if after is None or len(after) > self._left - 1:
            self._matcher.rollback(1)
            return False
        self._path, self._left = after, self._left - 1
        return True

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, taken in order from the current state, the grammar allows
        (nothing is consumed): a draft is cut there."""
        if self._matcher.is_error():
            return 0
        return int(self._matcher.validate_tokens(tokens))

    def closing_token(self) -> int:
        """A token :meth:`advance` always takes: the next one of the closing path, or the end
        of sequence when the output may end here.

        Raises:
            RuntimeError: The guide does not close (no budget was given).
        """
        if self._path is None:
            raise RuntimeError("this guide has no closing path: compile it with a budget")
        if self._path:
            return self._path[0]
        return min(self._eos_ids)

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"constrained decoding failed: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole match (the output may end here)."""
        return bool(self._matcher.is_accepting())

    @property
    def finished(self) -> bool:
        """Whether the text so far is a whole match that nothing but the end of sequence may
        follow."""
        return bool(self._matcher.is_accepting() and self._matcher.is_stopped())


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
        self._planner: ClosingPlanner | None = None
        self._lock = threading.Lock()

    def _tokenizer_view(self) -> Any:
        with self._lock:
            if self._view is None:
                import llguidance.hf

                self._view = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids or None
                )
                self._planner = ClosingPlanner(self._view)
            return self._view

    def compile(self, constraint: OutputConstraint, budget: int | None = None) -> GrammarGuide:
        """A fresh guide for one sequence.

        Args:
            constraint: What the output must match.
            budget: Most tokens the output may take: the guide then closes the output within
                it (``None``: no closing, as when the budget is unknown).

        Raises:
            InvalidInputError: llguidance is not installed, the schema or grammar is invalid
                (the message quotes the reason), or ``budget`` is below the fewest tokens a
                valid output takes (the message names that minimum).
        """
        guide = self._guide(constraint, budget)
        minimum = guide.minimum_tokens
        what = _kind(constraint)
        if budget is not None and minimum is None:
            logger.debug("no closing path found for this %s: the output is not closed within its budget", what)
        if budget is not None and minimum is not None and budget < minimum:
            raise InvalidInputError(
                f"max_new_tokens={budget} is below the {minimum} tokens the shortest output valid for this "
                f"{what} takes; raise max_new_tokens to at least {minimum} (or shorten the prompt when the "
                "context window is what limits it)"
            )
        return guide

    def minimum_tokens(self, constraint: OutputConstraint) -> int | None:
        """The fewest tokens an output valid for ``constraint`` takes (its closing path from
        the start, end of sequence excluded): the smallest budget :meth:`compile` accepts.
        ``None`` when no closing path is known (such a constraint is not closed).

        Raises:
            InvalidInputError: As :meth:`compile`, but never for the budget.
        """
        return self._guide(constraint, sys.maxsize).minimum_tokens

    def _guide(self, constraint: OutputConstraint, budget: int | None) -> GrammarGuide:
        try:
            import llguidance
        except ImportError:
            raise InvalidInputError(_INSTALL_HINT) from None
        try:
            grammar = llguidance_grammar(constraint)
        except ValueError as exc:
            raise InvalidInputError(f"invalid output constraint: {exc}") from None
        view = self._tokenizer_view()
        matcher = llguidance.LLMatcher(view, grammar, log_level=0)
        if matcher.is_error():
            what = _kind(constraint)
            raise InvalidInputError(
                f"invalid {what} for constrained decoding: {matcher.get_error()}; fix the {what} "
                "(JSON schemas: draft 2020-12 keywords, local $refs only)"
            )
        eos_ids = self._eos_ids or [int(view.eos_token)]
        return GrammarGuide(matcher, self._vocab_size, self._planner, budget, eos_ids)


def _kind(constraint: OutputConstraint) -> str:
    """How messages name ``constraint``: ``"JSON schema"`` or ``"grammar"``."""
    return "JSON schema" if constraint.json_schema is not None else "grammar"
