"""Token-boundary checks of shared beginnings (kvboost_rag.shared_beginning)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvboost_rag.shared_beginning import (
    BOUNDARY_PROBE_CHARS,
    longest_shared_beginning,
    on_token_boundary,
    token_boundary_holds,
)
from kvboost_rag.testing import tiny_tokenizer

SYSTEM = "Answer from the context only."


@pytest.fixture(scope="module")
def token_ids() -> Callable[[str], list[int]]:
    tokenizer = tiny_tokenizer()
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def test_clean_boundary_is_kept_as_is(token_ids) -> None:
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is a list?"
    candidate = "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert token_boundary_holds(candidate, prompt, token_ids)
    assert on_token_boundary(candidate, prompt, token_ids) == candidate


def test_tokens_merging_across_the_boundary_reject_the_candidate(token_ids) -> None:
    candidate, prompt = "def func", "def function(x): return x"
    # The tokenizer reads " function" as one token: "def func"'s last tokens are not a prefix.
    assert token_ids(prompt)[: len(token_ids(candidate))] != token_ids(candidate)
    assert not token_boundary_holds(candidate, prompt, token_ids)
    assert on_token_boundary(candidate, prompt, token_ids) is None  # no whitespace to trim


def test_trimming_trailing_whitespace_restores_the_boundary(token_ids) -> None:
    candidate = SYSTEM + "\n\n"
    prompt = candidate + "Context information is below."
    # "\n\n" alone is one token, before a word it is two: the untrimmed candidate misses.
    assert not token_boundary_holds(candidate, prompt, token_ids)
    shared = on_token_boundary(candidate, prompt, token_ids)
    assert shared is not None and shared != candidate
    assert candidate.startswith(shared) and shared.startswith(SYSTEM)
    assert token_ids(prompt)[: len(token_ids(shared))] == token_ids(shared)
    # Trimming stops after max_trimmed_whitespace characters.
    assert on_token_boundary(candidate, prompt, token_ids, max_trimmed_whitespace=0) is None


def test_only_a_short_probe_past_the_boundary_is_tokenized(token_ids) -> None:
    seen: list[int] = []

    def counting(text: str) -> list[int]:
        seen.append(len(text))
        return token_ids(text)

    candidate = "<|im_start|>system\nBe brief.<|im_end|>\n"
    prompt = candidate + "word " * 2000
    assert on_token_boundary(candidate, prompt, counting) == candidate
    assert max(seen) <= len(candidate) + BOUNDARY_PROBE_CHARS


def test_candidates_that_are_not_a_proper_prefix_are_rejected(token_ids) -> None:
    assert on_token_boundary("Be brief.", "Something else entirely", token_ids) is None
    # A prompt that is only its beginning has nothing to share.
    assert on_token_boundary("Be brief.", "Be brief.", token_ids) is None
    assert on_token_boundary("", "Be brief.", token_ids) is None
    assert not token_boundary_holds("", "Be brief.", token_ids)


def test_longest_qualifying_candidate_wins(token_ids) -> None:
    system_turn = "<|im_start|>system\nBe brief.<|im_end|>\n"
    with_header = system_turn + "<|im_start|>user\n"
    prompt = with_header + "What is a list?<|im_end|>\n<|im_start|>assistant\n"
    assert longest_shared_beginning([system_turn, with_header, None, ""], prompt, token_ids) == with_header
    # A longer candidate that is no prefix falls back to the next one.
    assert longest_shared_beginning([system_turn, "<|im_start|>user\nX"], prompt, token_ids) == system_turn
    assert longest_shared_beginning([], prompt, token_ids) is None
