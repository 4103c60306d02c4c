"""How many prompt tokens a step carries beside the running answers' next tokens.

Every step of the engine loop runs the running answers' next tokens (their decode rows) and,
while prompt work waits, a slice of it, in one forward pass. A stream's gap between two
pieces is then one step, and the slice decides how long that step takes. :class:`StepBudget`
sizes it from the steps it measured:

- on a CPU, the streams' usual step is what the recent steps without prompt work took for as
  many rows (:func:`usual_step`: a least-squares line through their times by rows); a step
  with prompt work should take ``1 + max_decode_wait`` times that, or, while more
  requests wait for their first token than rows decode (a burst), ``1 + max_decode_wait x
  requests waiting / rows`` times: each request waiting for its first token weighs as much as
  each stream waiting for its next, so a burst reaches its first tokens sooner (a slice of a
  few tokens spends most of its pass reading the weights) and its first streams pause longer
  meanwhile, while one request beside open streams keeps their pauses bounded. After every step with prompt work the slice is scaled by the target over the time
  the step took (at most halved or doubled at once), so it follows what the machine, the
  prompts' lengths and the rows' drafts make a step cost, with no model of them; it starts at
  :data:`PRIOR_TOKENS`;
- on CUDA a token budget in vLLM's spirit (``max_num_batched_tokens``): the decode rows and
  the prompt slice together at most ``prefill_chunk_tokens`` tokens (decode rows cost little
  beside a prefill chunk there);
- with no decode row running, nobody waits: ``prefill_chunk_tokens`` (``"auto"``: 512 on a CPU,
  2048 on CUDA), the most prompt tokens a step ever carries.

While prompt work waits on a CPU, a decode row runs at most :data:`ROW_TOKENS_BESIDE_PROMPTS`
tokens (:meth:`StepBudget.row_tokens`): a step of more than a few rows is bound by arithmetic
there, so long drafts would take the prompt's share of the step; the first drafts, the most
often accepted, stay.

A step always carries at least :data:`MIN_SLICE` prompt tokens when prompt work waits, so a
prompt makes progress however the measurements stand; on a CPU, at least the floor of
:class:`SliceCosts`: the smallest slice whose prompt tokens cost about what they cost with no
decode row beside them (measured: on a 2-core AMD EPYC, embedded model, a token of a 32-token
slice beside 4 rows cost 1.44x its idle cost, of a 64-token slice 1.16x, of 128 0.96x; a
1.2k-token prompt beside streams took 16.4 s when every slice, the streams' own prompts'
too, was 16 tokens, 1.9 s at 32). Below that
floor a pause bound costs the waiting requests more than it saves the streams: 12 cold
requests at once took longer than one after another.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque

from kvboost_rag.config import KVBoostSettings

logger = logging.getLogger(__name__)

#: Prompt tokens of a step beside decode rows before any such step was measured.
PRIOR_TOKENS = 64
#: Fewest prompt tokens a step carries while prompt work waits.
MIN_SLICE = 16
#: Recent steps without prompt work the streams' usual step is taken from.
USUAL_WINDOW = 30
#: Steps of the same rows count among them that make their median the usual step.
SAME_ROWS = 3
#: Most tokens a decode row runs (its pending token and drafts) while prompt work waits, on a CPU.
ROW_TOKENS_BESIDE_PROMPTS = 4
#: Most the slice changes after one step (by this factor, or its inverse).
MAX_CHANGE = 2.0
#: A slice beside decode rows is efficient while its prompt tokens cost at most this many
#: times what a prompt token costs in a step with no decode row.
EFFICIENT_COST = 1.3
#: Recent measurements kept per slice size (and of the idle cost per token).
COST_WINDOW = 9


class SliceCosts:
    """What a prompt token costs by the size of its slice, measured (CPU).

    A step with no decode row sets the idle cost of a prompt token (its time over its
    tokens, from steps of at least half the largest slice). A step beside decode rows adds
    its slice's time beyond the rows' usual step, per prompt token, to the slices of its size
    class (powers of two from :data:`MIN_SLICE`). :meth:`floor` is the smallest size class
    above every class measured costlier than :data:`EFFICIENT_COST` times the idle cost: slices
    start small and grow past the sizes that prove dear, so the prompts' work costs about what
    it costs alone while streams decode beside it.
    """

    def __init__(self) -> None:
        self._idle: deque[float] = deque(maxlen=COST_WINDOW)
        self._by_size: dict[int, deque[float]] = {}

    @staticmethod
    def size_class(tokens: int) -> int:
        """The power of two (at least :data:`MIN_SLICE`) at or below ``tokens``."""
        return max(MIN_SLICE, 1 << (max(tokens, 1).bit_length() - 1))

    def record_idle(self, tokens: int, seconds: float, limit: int) -> None:
        """A step of ``tokens`` prompt tokens and no decode row took ``seconds``."""
        if tokens * 2 >= limit and seconds > 0:
            self._idle.append(seconds / tokens)

    def record_beside(self, tokens: int, extra_seconds: float) -> None:
        """A slice of ``tokens`` beside decode rows added ``extra_seconds`` to their step."""
        if tokens >= MIN_SLICE:
            self._by_size.setdefault(self.size_class(tokens), deque(maxlen=COST_WINDOW)).append(max(extra_seconds, 0.0) / tokens)

    def floor(self, limit: int) -> int:
        """Fewest prompt tokens a slice beside decode rows should carry (see the class)."""
        if not self._idle:
            return MIN_SLICE
        dear = EFFICIENT_COST * statistics.median(self._idle)
        measured = [size for size, costs in self._by_size.items() if statistics.median(costs) > dear]
        return min(limit, 2 * max(measured)) if measured else MIN_SLICE


def usual_step(steps: list[tuple[int, float]], rows: int) -> float | None:
    """What a step without prompt work takes for ``rows`` decode rows, from recent such steps
    ``(rows, seconds)``: the median of those with as many rows (at least :data:`SAME_ROWS` of
    them: what the streams' gaps were); else a least-squares line through them when their rows
    varied, else their median, with each row beyond (or short of) theirs counted as another
    such step's share (half a step when one row decoded: a pass reads the weights once
    whatever its rows); ``None`` before any step."""
    if not steps:
        return None
    same = [s for r, s in steps if r == rows]
    if len(same) >= SAME_ROWS:
        return statistics.median(same)
    counts = [r for r, _ in steps]
    times = [s for _, s in steps]
    mean_r, mean_s = sum(counts) / len(counts), sum(times) / len(times)
    spread = sum((r - mean_r) ** 2 for r in counts)
    if spread > 0:
        slope = sum((r - mean_r) * (s - mean_s) for r, s in steps) / spread
        if slope > 0 and mean_s - slope * mean_r > 0:
            return mean_s + slope * (rows - mean_r)
    typical_rows, typical = statistics.median(counts), statistics.median(times)
    return typical * (1 + (rows - typical_rows) / (typical_rows + 1))


class StepBudget:
    """Prompt tokens per step, from measured step times.

    Args:
        settings: Engine settings (``max_decode_wait`` and ``prefill_chunk_tokens``, read at
            every step).
        device_type: The model's device type.
    """

    def __init__(self, settings: KVBoostSettings, device_type: str) -> None:
        self._settings = settings
        self._device_type = device_type
        self._decode_only: deque[tuple[int, float]] = deque(maxlen=USUAL_WINDOW)
        self._slice = float(PRIOR_TOKENS)
        self.costs = SliceCosts()
        self._lock = threading.Lock()

    def usual_step(self, rows: int) -> float | None:
        """The streams' usual step for ``rows`` decode rows (seconds; ``None`` before any step
        without prompt work; see :func:`usual_step`)."""
        with self._lock:
            return usual_step(list(self._decode_only), rows)

    def row_tokens(self, prompt_waiting: bool) -> int | None:
        """Most tokens a decode row runs this step: :data:`ROW_TOKENS_BESIDE_PROMPTS` while
        prompt work waits on a CPU; else ``None`` (what the draft policy chooses)."""
        return ROW_TOKENS_BESIDE_PROMPTS if prompt_waiting and self._device_type != "cuda" else None

    def prompt_tokens(self, rows: int, decode_tokens: int) -> int:
        """Most prompt tokens a step carries beside ``rows`` decode rows feeding
        ``decode_tokens`` tokens."""
        limit = self._settings.prefill_chunk_for(self._device_type)
        if rows == 0:
            return limit
        if self._device_type == "cuda":
            return max(MIN_SLICE, limit - decode_tokens)
        with self._lock:
            return max(self.costs.floor(limit), min(limit, round(self._slice)))

    def record(self, rows: int, prompt_tokens: int, seconds: float, requests_waiting: int = 1) -> None:
        """Account for one step: its decode rows, the prompt tokens it carried, its wall time,
        and the requests waiting for their first token meanwhile."""
        limit = self._settings.prefill_chunk_for(self._device_type)
        if not rows:
            if prompt_tokens:
                with self._lock:
                    self.costs.record_idle(prompt_tokens, seconds, limit)
            return
        with self._lock:
            if not prompt_tokens:
                self._decode_only.append((rows, seconds))
                return
            usual = usual_step(list(self._decode_only), rows)
            if usual is None or seconds <= 0:
                return
            self.costs.record_beside(prompt_tokens, seconds - usual)
            target = (1 + self._settings.max_decode_wait * max(1.0, requests_waiting / rows)) * usual
            change = min(MAX_CHANGE, max(1 / MAX_CHANGE, target / seconds))
            scaled = prompt_tokens * change
            # A step whose work ran short of the slice shows no reason to shrink it, unless even
            # its shorter slice took too long.
            scaled = max(self._slice, scaled) if change >= 1 else min(self._slice, scaled)
            self._slice = min(float(limit), max(float(MIN_SLICE), scaled))
        logger.debug(
            "step of %d rows and %d prompt tokens: %.0f ms (target %.0f ms); next slice %.0f",
            rows, prompt_tokens, seconds * 1000, target * 1000, self._slice,
        )
