"""Drafting from the prompt's texts: the token indexes, the drafter's choice of match, and the
policy that sets draft lengths."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvboost_rag import KVBoostSettings
from kvboost_rag.decode.draft_policy import COST_WINDOW, MIN_COST_SAMPLES, DraftPolicy, SequenceDrafts, StepCosts, token_bucket
from kvboost_rag.decode.drafting import Drafter, drafter_for
from kvboost_rag.request.documents import make_record
from kvboost_rag.request.ngrams import GrowingIndex, TokenIndex


def _reference_find(ids: list[int], context: list[int], longest: int, starts: set[int] | None = None):
    """Brute force: ``(length, end)`` of the longest match (latest among equals) of the
    context's last tokens (at least two) followed by at least one more token."""
    best = None
    for s in range(len(ids) - 2):
        if starts is not None and s not in starts:
            continue
        if ids[s : s + 2] != context[-2:]:
            continue
        length = 2
        while length < min(longest, len(context)) and s - (length - 1) >= 0 and ids[s - (length - 1)] == context[-(length + 1)]:
            length += 1
        if best is None or length >= best[0]:
            best = (length, s + 2)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_both_indexes_find_what_a_brute_force_search_finds(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 40])  # small vocabularies: many repeats and long matches
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(20, 200))]
    growing = GrowingIndex()
    growing.extend(ids)
    full = TokenIndex(ids)
    starts = set(rng.sample(range(len(ids)), len(ids) // 2))
    partial = TokenIndex(ids, starts=np.array(sorted(starts)))
    for _ in range(60):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(2, 10))]
        if rng.random() < 0.5:  # a context that surely occurs
            end = rng.randrange(2, len(ids))
            context = ids[max(0, end - rng.randrange(2, 10)) : end]
            if len(context) < 2:
                continue
        array = np.array(context, dtype=np.int64)
        for longest in (2, 4, 8):
            expected = _reference_find(ids, context, longest)
            for index in (full, growing):
                match = index.find(array, longest)
                assert (None if match is None else (match.length, match.end)) == expected
            expected = _reference_find(ids, context, longest, starts)
            match = partial.find(array, longest)
            assert (None if match is None else (match.length, match.end)) == expected


def test_a_match_needs_a_following_token():
    index = TokenIndex([5, 6, 7, 5, 6])
    match = index.find(np.array([5, 6]), 8)
    assert (match.length, match.end) == (2, 2)  # the later 5 6 ends the text: nothing follows it
    assert TokenIndex([5, 6]).find(np.array([5, 6]), 8) is None


def test_the_drafter_prefers_longer_matches_then_the_answer_then_later_documents():
    first = TokenIndex([1, 2, 3, 10, 11])
    second = TokenIndex([9, 2, 3, 20, 21, 22])
    prompt = TokenIndex([7, 2, 3, 30])
    drafter = Drafter([second, first], prompt, context=[8, 2, 3])
    proposal = drafter.propose(8)
    assert (proposal.tokens, proposal.source, proposal.match_length) == ([20, 21, 22], "document", 2)
    assert drafter.propose(2).tokens == [20, 21]  # at most ``limit`` tokens
    drafter = Drafter([second, first], prompt, context=[1, 2, 3])
    assert drafter.propose(8).tokens == [10, 11]  # three matched tokens beat two
    drafter = Drafter([second, first], prompt, context=[8])
    drafter.accept([2, 3, 40, 41, 2, 3])  # the answer so far holds "2 3" followed by 40
    proposal = drafter.propose(8)
    assert (proposal.tokens, proposal.source) == ([40, 41, 2, 3], "answer")
    assert Drafter([first], None, context=[99, 98]).propose(8) is None


def test_a_plan_drafts_from_its_documents_records_and_the_rest_of_its_text(tokenizer):
    from kvboost_rag.request.documents import DocumentRegistry
    from kvboost_rag.request.hashing import root_hash
    from kvboost_rag.request.plan import Planner, PromptTokens

    document = "The pass statement is a null operation; nothing happens when it executes."
    ids = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
    record = make_record(document, ids["input_ids"], ids["offset_mapping"], "fp", 16)
    registry = DocumentRegistry()
    registry.register(record)
    prompt = "Answer from the text below, in full sentences.\n\n" + document + "\n\nQuestion: what does pass do?\nAnswer:"
    enc = tokenizer(prompt, return_offsets_mapping=True)
    plan = Planner(root_hash("fp"), 16, lambda: registry).plan(PromptTokens(prompt, enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]))
    assert len(plan.documents) == 1
    drafter = drafter_for(plan)
    covered = set(plan.documents[0].positions)
    assert drafter._documents == [record.ngrams]
    live_starts = set(drafter._prompt._starts.tolist())
    assert live_starts and not live_starts & covered  # the prompt's own index skips the document
    # The answer starts quoting the document: the drafter proposes the document's next tokens.
    quoted = record.token_ids[:3]
    drafter.accept(quoted)
    assert drafter.propose(5).tokens == list(record.token_ids[3:8])


def test_token_buckets():
    assert [token_bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 40)] == [1, 2, 4, 4, 8, 16, 16, 16]


def test_step_costs_start_from_the_device_prior_and_follow_the_median_of_recent_steps():
    costs = StepCosts("cpu")
    assert costs.ratio(1, 1) == 1.0
    assert costs.ratio(1, 8) > costs.ratio(1, 2) > 1.0
    assert StepCosts("cuda").ratio(1, 8) < costs.ratio(1, 8)
    prior = costs.ratio(1, 8)
    for _ in range(MIN_COST_SAMPLES - 1):
        costs.record(1, 1, 0.1)
        costs.record(1, 8, 0.13)
    assert costs.ratio(1, 8) == prior  # too few steps yet
    costs.record(1, 1, 0.1)
    costs.record(1, 8, 0.13)
    assert costs.ratio(1, 8) == pytest.approx(1.3)
    costs.record(1, 8, 2.0)  # one step slowed by other work on the machine: the estimate holds
    costs.record(1, 1, 0.5)
    assert costs.ratio(1, 8) == pytest.approx(1.3)
    for _ in range(COST_WINDOW):
        costs.record(1, 8, 0.2)  # longer steps that got dearer for good: it follows
    assert costs.ratio(1, 8) == pytest.approx(2.0)
    assert costs.ratio(2, 8) == StepCosts("cpu").ratio(2, 8)  # other batch sizes keep their prior


def _policy(device: str = "cpu", draft_tokens: int = 15) -> DraftPolicy:
    return DraftPolicy(KVBoostSettings(draft_tokens=draft_tokens), device)


def test_the_policy_drafts_long_where_drafts_are_accepted_and_not_where_they_are_not():
    policy = _policy()
    sequence = SequenceDrafts()
    start = policy.length(sequence, "document", 4, 15, 1)
    assert start > 0  # the prior expects a long match to be worth drafting
    for _ in range(30):
        policy.record(sequence, "document", 4, accepted=15, evaluated=15)
    assert policy.length(sequence, "document", 4, 15, 1) == 15
    assert policy.length(sequence, "document", 4, 3, 1) == 3  # never more than the continuation
    rejecting = SequenceDrafts()
    for _ in range(30):
        policy.record(rejecting, "answer", 2, accepted=0, evaluated=1)
    assert policy.length(rejecting, "answer", 2, 15, 1) == 0


def test_the_policy_follows_the_measured_cost_of_longer_steps():
    policy = _policy()
    sequence = SequenceDrafts()
    for _ in range(10):
        policy.record(sequence, "document", 3, accepted=1, evaluated=2)  # about one token accepted a draft
    for _ in range(MIN_COST_SAMPLES):
        policy.costs.record(1, 1, 0.1)
        for bucket in (2, 4, 8, 16):
            policy.costs.record(1, bucket, 0.1)  # longer steps cost nothing more: draft
    assert policy.length(sequence, "document", 3, 15, 1) > 0
    for bucket in (2, 4, 8, 16):
        for _ in range(20):
            policy.costs.record(1, bucket, 0.5)  # five times a plain step: not worth it
    assert policy.length(sequence, "document", 3, 15, 1) == 0


def test_the_setting_turns_drafting_off_and_is_validated():
    assert _policy(draft_tokens=0).length(SequenceDrafts(), "document", 8, 15, 1) == 0
    assert _policy(draft_tokens=4).length(SequenceDrafts(), "document", 8, 15, 1) <= 4
    with pytest.raises(ValueError):
        KVBoostSettings(draft_tokens=-1)
    with pytest.raises(ValueError):
        KVBoostSettings(draft_tokens=16)


def test_declined_drafts_are_tried_again_now_and_then():
    from kvboost_rag.decode.draft_policy import EXPLORE_EVERY

    policy = _policy()
    rejecting = SequenceDrafts()
    for _ in range(30):
        policy.record(rejecting, "answer", 2, accepted=0, evaluated=1)
    lengths = [policy.length(rejecting, "answer", 2, 15, 1) for _ in range(2 * EXPLORE_EVERY)]
    assert lengths.count(1) == 2 and set(lengths) == {0, 1}
    assert lengths[EXPLORE_EVERY - 1] == 1
