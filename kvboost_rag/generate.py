"""Sampling, stop strings and incremental detokenization for the decode loop.

The engine does prefill; this module turns logits into tokens and tokens into text pieces:
``TextAssembler`` decodes incrementally, holds back text that could be the start of a stop
string or an unfinished UTF-8 character, and cuts the output at the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvboost_rag.errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    """Validated decoding parameters.

    Attributes:
        max_new_tokens: Upper bound on generated tokens (>= 1).
        temperature: 0 for greedy decoding, else softmax temperature.
        top_p: Nucleus sampling mass in (0, 1].
        seed: Seed of the sampling generator (reproducible sampling).
        stop: Strings that end the output (the output is cut before the first one).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidInputError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A seeded torch generator, or ``None`` to use the global RNG."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from ``[vocab]`` logits (greedy when temperature is 0)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        keep = cumulative - sorted_probs < params.top_p  # always keeps the top token
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

    def add(self, token_id: int) -> str:
        """Add one token; returns the new text that is safe to emit (may be empty)."""
        self.token_ids.append(token_id)
        self.text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._emit(len(self.text))
        safe = len(self.text) - self._holdback
        while safe > self._emitted and self.text[safe - 1] == "\ufffd":
            safe -= 1
        return self._emit(safe)

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

    def _first_stop(self) -> int | None:
        positions = [p for p in (self.text.find(s) for s in self._stop) if p >= 0]
        return min(positions) if positions else None

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece
