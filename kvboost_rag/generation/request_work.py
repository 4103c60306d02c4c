"""What the engine loop runs for one request: its prefill, its first token, and its sequence
joining the running batch.

The request's thread plans the prompt and looks it up; the rest is prompt work
(:mod:`kvboost_rag.engine_loop.work`) the loop admits (its place and buffers, granted when there
is room) and drives on its own thread, so the first token is chosen and the sequence decodes
from the very next step, whatever the request's thread is doing. Whatever ends the work before
its sequence joins the batch (an error, a cancellation) gives back what it was granted, here;
a first token that ends the answer gives its place back at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from kvboost_rag.decode.constrained import GrammarGuide
from kvboost_rag.decode.drafting import drafter_for
from kvboost_rag.decode.handle import DecodeHandle
from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler, make_generator
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.engine_loop import Admission, BatchPlaces, JoinDecode, Reservation
from kvboost_rag.generation.holdings import give_back
from kvboost_rag.generation.slots import Lease
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.passes import PassSteps
from kvboost_rag.prefill.outcome import PrefillOutcome
from kvboost_rag.prefill.prefiller import Lookup, Prefiller
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import PromptPlan


@dataclass
class Started:
    """What a request's prompt work returns to its caller.

    Attributes:
        outcome: Its prefill outcome.
        sequence: Its decode state, its first token chosen.
        first_pieces: Text of the first token.
        first_token_at: ``perf_counter`` when the first token was chosen.
        handle: Its sequence's pieces (``None``: the first token ended it).
        reservation: Its place in the batch (given back already when ``handle`` is ``None``).
        lease: Its K/V buffers on loan (``None``: buffers of its own).
    """

    outcome: PrefillOutcome
    sequence: DecodeSequence
    first_pieces: list[str]
    first_token_at: float
    handle: DecodeHandle | None
    reservation: Reservation
    lease: Lease | None


@dataclass(frozen=True)
class RequestWork:
    """One request's prompt work.

    Attributes:
        plan: Its plan.
        options: Its options.
        budget: Most tokens it may generate.
        guide: Its output constraint's state (``None``: none).
        eos_ids: End-of-sequence token ids.
    """

    plan: PromptPlan
    options: GenerationOptions
    budget: int
    guide: GrammarGuide | None
    eos_ids: frozenset[int]

    def steps(
        self, prefiller: Prefiller, found: Lookup | None, adapter: ModelAdapter,
        admission: Admission[tuple[Reservation, Lease | None]], places: BatchPlaces,
    ) -> PassSteps[Started]:
        """Once admitted (its place and buffers granted by the loop before the first step):
        prefill (what ``found`` holds reused; ``None``: full prefill), choose the first token,
        and join the running batch, with the lookahead repair before the first step."""
        assert admission.granted is not None, "a request's work starts once admitted"
        reservation, lease = admission.granted
        try:
            buffers, slot = (lease.buffers, lease.slot) if lease is not None else (None, None)
            outcome = yield from prefiller.steps(self.plan, found, buffers=buffers, slot=slot)
            sequence = self._sequence(outcome, adapter, lease)
            first_pieces = sequence.choose(outcome.logits)
            first_token_at = time.perf_counter()
            handle = None
            if sequence.done:  # the first token ended it: nothing steps it, its place goes back now
                places.release(reservation)
            else:
                before = None if outcome.follow_up is None else _look_ahead(outcome, sequence)
                handle = yield JoinDecode(sequence, reservation, before)
        except BaseException:  # failed or cancelled before it joined: all it holds goes back here
            give_back(places, reservation, lease)
            raise
        return Started(outcome, sequence, first_pieces, first_token_at, handle, reservation, lease)

    def _sequence(self, outcome: PrefillOutcome, adapter: ModelAdapter, lease: Lease | None) -> DecodeSequence:
        """The prefilled prompt's decode state."""
        options = self.options
        return DecodeSequence(
            cache=outcome.cache,
            position=self.plan.num_tokens,
            budget=self.budget,
            options=options,
            sampling=SequenceSampling(make_generator(options.seed, adapter.device), self.guide),
            assembler=TextAssembler(adapter.tokenizer, options.stop),
            eos_ids=self.eos_ids,
            make_drafter=partial(drafter_for, self.plan),
            slot=None if lease is None else lease.slot,
        )


def _look_ahead(outcome: PrefillOutcome, sequence: DecodeSequence) -> PassSteps[None]:
    """Run a prefill's follow-up repair with the sequence's first token and count what it
    recomputed (those tokens no longer count as read from cache)."""
    if outcome.follow_up is None or sequence.token is None:
        return
    outcome.recomputed_tokens += yield from outcome.follow_up(sequence.token)
    if outcome.content_tokens:
        outcome.recompute_ratio = outcome.recomputed_tokens / outcome.content_tokens
