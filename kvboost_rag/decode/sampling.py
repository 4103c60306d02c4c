"""Sampling, stop strings and incremental detokenization for the decode loop.

The engine does prefill; this module turns logits into tokens and tokens into text pieces:
``TextAssembler`` decodes incrementally, holds back text that could be the start of a stop
string or an unfinished UTF-8 character, and cuts the output at the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import RepetitionPenaltyLogitsProcessor

if TYPE_CHECKING:
    from kvboost_rag.request.options import GenerationOptions


#: Tokens a sequence may sample and have refused (their closing would not fit the tokens
#: left) before it takes its constraint's closing token.
MAX_REFUSED_SAMPLES = 3


class TokenGuide(Protocol):
    """Per-sequence constraint state (see :mod:`kvboost_rag.decode.constrained`)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the logits with the tokens the constraint forbids next set to ``-inf``."""

    def advance(self, token: int) -> bool:
        """Record the token chosen; ``False`` (nothing recorded) refuses it: the output could
        not be completed within the tokens left after it."""

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order from the current state, the constraint allows
        (nothing is consumed)."""

    def closing_token(self) -> int:
        """A token ``advance`` always takes (the next one of the shortest way to close)."""

    @property
    def complete(self) -> bool:
        """Whether the output so far is a whole match (it may end here)."""

    @property
    def finished(self) -> bool:
        """Whether the output so far is a whole match nothing but the end may follow."""


@dataclass
class SequenceSampling:
    """What one sequence's token choice needs besides its logits and options.

    Attributes:
        generator: Seeded generator of the sequence (``None``: the global RNG).
        guide: Its output constraint's state, when ``options.constraint`` is set.
        generated: Tokens chosen so far (what ``repetition_penalty`` penalizes).
    """

    generator: torch.Generator | None = None
    guide: TokenGuide | None = None
    generated: list[int] = field(default_factory=list)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A seeded torch generator, or ``None`` to use the global RNG."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def plain_greedy(options: GenerationOptions, state: SequenceSampling) -> bool:
    """Whether the next token is simply the logits' argmax (greedy, no penalty, no constraint):
    a step may then take every row's argmax at once (:func:`next_token`'s ``argmax``)."""
    return options.temperature == 0 and options.repetition_penalty == 1.0 and state.guide is None


def next_token(logits: torch.Tensor, options: GenerationOptions, state: SequenceSampling, argmax: int | None = None) -> int:
    """Choose one sequence's next token from its ``[vocab]`` logits.

    The one place a token is chosen: the repetition penalty (if any) lowers the logits of
    tokens already generated, the constraint (if any) masks the logits, the options'
    temperature and top-p pick a token, and the constraint moves past it.

    Args:
        logits: ``[vocab]`` logits.
        options: The sequence's options.
        state: Its sampling state (the token is appended to ``generated``).
        argmax: The logits' argmax, when the caller computed it already (for many rows at
            once, one device read); used only where :func:`plain_greedy` holds.
    """
    if argmax is not None and plain_greedy(options, state):
        state.generated.append(argmax)
        return argmax
    if options.repetition_penalty != 1.0 and state.generated:
        logits = penalize_repeats(logits, state.generated, options.repetition_penalty)
    if state.guide is not None:
        logits = state.guide.mask(logits)
    token = sample_token(logits, options.temperature, options.top_p, state.generator)
    if state.guide is not None:
        token = _take_fitting(token, logits, options, state)
    state.generated.append(token)
    return token


def _take_fitting(token: int, masked: torch.Tensor, options: GenerationOptions, state: SequenceSampling) -> int:
    """Have the guide take ``token``, or, when it refuses (the output could not close within
    the tokens left after it), the next choice among the other allowed tokens, and after
    ``MAX_REFUSED_SAMPLES`` refusals its closing token."""
    guide = state.guide
    assert guide is not None
    for _ in range(MAX_REFUSED_SAMPLES):
        if guide.advance(token):
            return token
        masked[token] = float("-inf")  # ``mask`` returned a copy
        if not bool(torch.isfinite(masked).any()):
            break
        token = sample_token(masked, options.temperature, options.top_p, state.generator)
    token = guide.closing_token()
    if not guide.advance(token):
        raise RuntimeError("constrained decoding failed: the closing token was refused")
    return token


def penalize_repeats(logits: torch.Tensor, generated: Sequence[int], penalty: float) -> torch.Tensor:
    """``logits`` with each generated token's logit divided by ``penalty`` when positive and
    multiplied by it when negative (transformers' ``RepetitionPenaltyLogitsProcessor``, given
    the generated tokens only, so prompt tokens are left alone)."""
    ids = torch.tensor([list(generated)], device=logits.device)
    return RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.unsqueeze(0))[0]


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Pick the next token from ``[vocab]`` logits (greedy when temperature is 0)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # A temperature so small (5e-324 is 0 in float32) that the scaled logits overflow: the
        # limit of the softmax as the temperature goes to 0, the top tokens alike.
        probs = (logits == logits.max()).float()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        keep = cumulative - sorted_probs < top_p
        keep[..., 0] = True  # the top token, even for a top_p below float32's least (5e-324 is 0)
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


class TextAssembler:
    """Turns generated tokens into safe-to-show text pieces and applies stop strings.

    Args:
        tokenizer: The model's tokenizer.
        stop: Stop strings.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._emitted = 0
        self.stopped = False
        # Incremental detokenization: only the tokens from ``_prefix`` on are decoded again
        # at each step (the ones from ``_read`` on are not in ``text`` yet), so assembling an
        # output is linear in its length.
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        """Add one token; returns the new text that is safe to emit (may be empty)."""
        self.token_ids.append(token_id)
        decode = self._tokenizer.decode
        known = decode(self.token_ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self.token_ids[self._prefix :], skip_special_tokens=True)
        if len(window) > len(known) and not window.endswith("\ufffd"):
            searched_from = max(0, len(self.text) - self._holdback)  # a stop string may start there
            self.text += window[len(known) :]
            self._prefix, self._read = self._read, len(self.token_ids)
            cut = self._first_stop(searched_from)
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._holdback)

    def finish(self) -> str:
        """Everything not emitted yet (call once decoding ended)."""
        return self._emit(len(self.text))

    def trimmed_token_ids(self) -> list[int]:
        """Generated ids, without the tokens that only produced text after a stop string."""
        if not self.stopped:
            return list(self.token_ids)
        ids = list(self.token_ids)
        while ids and len(self._tokenizer.decode(ids[:-1], skip_special_tokens=True)) >= len(self.text):
            ids.pop()
        return ids

    def _first_stop(self, start: int = 0) -> int | None:
        """Where the first stop string begins in ``text``, looking from ``start`` on."""
        positions = [p for p in (self.text.find(s, start) for s in self._stop) if p >= 0]
        return min(positions) if positions else None

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """Token ids that end a sequence: the generation config's and the tokenizer's EOS."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
