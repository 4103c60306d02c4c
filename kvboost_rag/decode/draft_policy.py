"""How many drafted tokens a decode step carries: as many as pay for themselves here.

A verify step runs the pending token and ``k`` drafted ones in one forward pass. What that pass
costs against a plain one-token step depends on the machine and the cache's length: on a GPU a
few more tokens cost almost nothing; on a CPU, with the small-row kernels, 2, 4 and 8 tokens
cost about 1.05x, 1.15x and 1.4x one over a 2k-token cache (8 rows of a 0.5B model take about as
long to compute as its weights take to read; attention grows with the tokens). What it gains
depends on the text: a draft from a long match in a document the answer quotes is mostly
accepted, one from a two-token match often is not. :class:`DraftPolicy` weighs both: it keeps
the wall time of recent steps per rows and tokens per row (:class:`StepCosts`: the median of the
last few, priors by device until measured, so a step slowed by other work moves it little), and
the share of drafted tokens accepted, by source and match length, across the engine and for the
sequence (:class:`Acceptance`), and drafts the length (padded to a token bucket) with the most
expected tokens per unit of step time; none when no length is expected to beat a plain step. The
tokens decoded never depend on this choice, only the time they take.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from kvboost_rag.config import KVBoostSettings

#: Tokens per row a step runs (the pending token plus drafts), rows padded up to one of these.
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
#: Recent step times kept per rows and tokens per row; the estimate is their median, so a
#: step slowed by other work on the machine moves it little and one run decides as the next.
COST_WINDOW = 15
#: Steps of a kind measured before their median replaces the device's prior.
MIN_COST_SAMPLES = 3
#: How much better than a plain step a draft must be expected to do (noise margin).
MIN_GAIN = 1.05
#: Match lengths told apart (longer ones count as the last).
MATCH_BUCKETS = (2, 3, 4, 6)
#: Per-step decay of the engine's acceptance counts (recent drafts weigh most).
ENGINE_DECAY = 0.995
#: Pseudo-trials of the engine's estimate in a sequence's own estimate.
PRIOR_STRENGTH = 4.0
#: One in this many proposals the policy would not draft is drafted anyway (the shortest
#: bucket), so an estimate that fell too low is measured again.
EXPLORE_EVERY = 32


def token_bucket(tokens: int) -> int:
    """The smallest bucket holding ``tokens`` tokens per row (the largest bucket beyond it)."""
    for bucket in TOKEN_BUCKETS:
        if tokens <= bucket:
            return bucket
    return TOKEN_BUCKETS[-1]


def _prior_cost_ratio(device_type: str, tokens: int) -> float:
    """Step time of ``tokens`` tokens per row over a one-token step, before any is measured:
    on a CPU, what the embedded model's steps cost with the small-row kernels
    (:mod:`kvboost_rag.decode_weights.small_rows`) over a 2.4k-token cache (1.07x, 1.2x, 1.5x, 1.9x at 2,
    4, 8, 16 tokens). Where steps cost more, :data:`MIN_COST_SAMPLES` steps of a kind replace it."""
    if device_type == "cuda":
        return 1.0 + 0.03 * (tokens - 1)
    return 1.0 + 0.06 * (tokens - 1)


class StepCosts:
    """Recent wall time of decode steps by ``(rows, tokens per row)``: the median of the last
    :data:`COST_WINDOW` of each, the device's prior until :data:`MIN_COST_SAMPLES` are in.

    Args:
        device_type: The model's device type (sets the priors).
    """

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self._seconds: dict[tuple[int, int], deque[float]] = {}
        self._lock = threading.Lock()

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """Account for one step."""
        with self._lock:
            self._seconds.setdefault((rows, tokens), deque(maxlen=COST_WINDOW)).append(seconds)

    def seconds(self, rows: int, tokens: int) -> float | None:
        """The median time of such steps, ``None`` before :data:`MIN_COST_SAMPLES`."""
        with self._lock:
            recent = list(self._seconds.get((rows, tokens), ()))
        return statistics.median(recent) if len(recent) >= MIN_COST_SAMPLES else None

    def ratio(self, rows: int, tokens: int) -> float:
        """Time of a step of ``tokens`` tokens per row over a one-token step of as many rows
        (measured where both were, else the device's prior); at least 1."""
        if tokens == 1:
            return 1.0
        base, cost = self.seconds(rows, 1), self.seconds(rows, tokens)
        if base is None or cost is None:
            return _prior_cost_ratio(self._device_type, tokens)
        return max(1.0, cost / base)


def _match_bucket(length: int) -> int:
    return max(i for i, low in enumerate(MATCH_BUCKETS) if length >= low)


@dataclass
class Rate:
    """Accepted out of tried, as (possibly decayed) counts."""

    accepted: float
    tried: float

    @property
    def value(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0

    def add(self, accepted: float, tried: float, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + accepted
        self.tried = self.tried * decay + tried


def _first_prior(bucket: int) -> Rate:
    return Rate(accepted=(0.3, 0.45, 0.6, 0.75)[bucket] * 2, tried=2.0)


@dataclass
class Acceptance:
    """How often drafted tokens were accepted: the first token of a draft by source and match
    length, and each later one (given the one before was accepted) by source.

    Attributes:
        priors: Counts start from a prior guess (the engine's), else from nothing (a sequence's).
        first: ``(source, match bucket) -> Rate`` of first drafted tokens.
        later: ``source -> Rate`` of later drafted tokens.
    """

    priors: bool = True
    first: dict[tuple[str, int], Rate] = field(default_factory=dict)
    later: dict[str, Rate] = field(default_factory=dict)

    def first_rate(self, source: str, match_length: int) -> Rate:
        key = (source, _match_bucket(match_length))
        if key not in self.first:
            self.first[key] = _first_prior(key[1]) if self.priors else Rate(0.0, 0.0)
        return self.first[key]

    def later_rate(self, source: str) -> Rate:
        if source not in self.later:
            self.later[source] = Rate(accepted=1.5, tried=2.0) if self.priors else Rate(0.0, 0.0)
        return self.later[source]

    def record(self, source: str, match_length: int, accepted: int, evaluated: int, decay: float = 1.0) -> None:
        """Account for a draft of which ``evaluated`` tokens were compared with the model's
        choice (the first ``accepted`` of them matched)."""
        if evaluated < 1:
            return
        self.first_rate(source, match_length).add(float(accepted >= 1), 1.0, decay)
        self.later_rate(source).add(float(max(accepted - 1, 0)), float(evaluated - 1), decay)


@dataclass
class SequenceDrafts:
    """One sequence's drafting: its own acceptance and what it drafted.

    Attributes:
        own: Its drafts' acceptance (blended with the engine's when choosing).
        drafted_tokens: Drafted tokens accepted.
        draft_steps: Steps that carried a draft.
        decode_steps: Forward passes after its first token.
    """

    own: Acceptance = field(default_factory=lambda: Acceptance(priors=False))
    drafted_tokens: int = 0
    draft_steps: int = 0
    decode_steps: int = 0


class DraftPolicy:
    """Chooses draft lengths for an engine and learns from every verified draft.

    Args:
        settings: Engine settings (``draft_tokens``: most tokens drafted per step, 0 for
            none; read at every step).
        device_type: The model's device type.
    """

    def __init__(self, settings: KVBoostSettings, device_type: str) -> None:
        self._settings = settings
        self.costs = StepCosts(device_type)
        self._engine = Acceptance()
        self._declined: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    @property
    def max_tokens(self) -> int:
        """Most tokens drafted per step now (0: drafting is off)."""
        return self._settings.draft_tokens

    def length(self, sequence: SequenceDrafts, source: str, match_length: int, available: int, rows: int) -> int:
        """Tokens to draft (0: none) from a continuation of ``available`` tokens found after a
        match of ``match_length`` tokens in ``source``, for a step of ``rows`` rows."""
        available = min(available, self.max_tokens)
        if available < 1:
            return 0
        first, later = self._estimates(sequence, source, match_length)
        best_value, best = MIN_GAIN, 0
        for bucket in TOKEN_BUCKETS[1:]:
            drafted = min(bucket - 1, available)
            expected = 1.0 + first * _geometric_sum(later, drafted - 1)
            value = expected / self.costs.ratio(rows, bucket)
            if value > best_value:
                best_value, best = value, drafted
            if drafted == available:
                break
        if best == 0 and self._explore(source, match_length):
            return 1
        return best

    def _explore(self, source: str, match_length: int) -> bool:
        """Whether to draft a proposal the estimates decline (one in :data:`EXPLORE_EVERY`
        per source and match bucket)."""
        key = (source, _match_bucket(match_length))
        with self._lock:
            count = self._declined[key] = self._declined.get(key, 0) + 1
        return count % EXPLORE_EVERY == 0

    def record(self, sequence: SequenceDrafts, source: str, match_length: int, accepted: int, evaluated: int) -> None:
        """Account for a verified draft (see :meth:`Acceptance.record`)."""
        sequence.own.record(source, match_length, accepted, evaluated)
        with self._lock:
            self._engine.record(source, match_length, accepted, evaluated, ENGINE_DECAY)

    def _estimates(self, sequence: SequenceDrafts, source: str, match_length: int) -> tuple[float, float]:
        """``(first, later)`` acceptance: the sequence's own counts over the engine's as a prior."""
        with self._lock:
            engine_first = self._engine.first_rate(source, match_length).value
            engine_later = self._engine.later_rate(source).value
        own_first = sequence.own.first.get((source, _match_bucket(match_length)))
        own_later = sequence.own.later.get(source)
        return _blend(own_first, engine_first), min(_blend(own_later, engine_later), 0.99)


def _blend(own: Rate | None, prior: float) -> float:
    if own is None:
        return prior
    return (own.accepted + PRIOR_STRENGTH * prior) / (own.tried + PRIOR_STRENGTH)


def _geometric_sum(ratio: float, terms: int) -> float:
    """``1 + ratio + ... + ratio ** terms`` (``terms + 1`` terms)."""
    return sum(ratio**i for i in range(terms + 1))
