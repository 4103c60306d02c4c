"""Constrained decoding: schema-valid output from random weights, errors, reuse untouched (the
decoding tests on the CPU and on CUDA, where the token masks apply to logits on the GPU)."""

from __future__ import annotations

import json
import logging
import re
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
from rag_prompts import SYSTEM_PROMPT

from kvboost_rag import InvalidInputError
from kvboost_rag.decode.constrained import OutputConstraint, masked_by_bitmask
from kvboost_rag.decode.sampling import SequenceSampling, next_token
from kvboost_rag.generation import completion as engine_module
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.options import GenerationOptions

pytest.importorskip("llguidance", reason="constrained decoding is the optional extra kvboost-rag[constrained]")


class Lookup(BaseModel):
    """A small tool call's arguments: an enum, a bounded string, an integer, a short list
    (a closed object: no extra keys, or random weights could add keys until the budget ends)."""

    model_config = ConfigDict(extra="forbid")

    section: Literal["reference", "library", "tutorial"]
    query: str = Field(max_length=24)
    top_k: int
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


@pytest.fixture
def engine(make_engine):
    return make_engine("llama")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", range(6))
def test_random_weights_give_schema_valid_json(make_engine, family, seed, device):
    engine = make_engine(family)
    schema = Lookup.model_json_schema()
    result = engine.generate(
        "Look something up.", max_new_tokens=96, temperature=1.0, seed=seed, constraint={"json_schema": schema}
    )
    assert result.finish_reason == "eos", result.output_text
    assert result.generated_tokens <= 96
    Lookup.model_validate_json(result.output_text)  # raises if not valid for the schema


def test_json_mode_outputs_close_within_the_budget(engine, device):
    # Any object is allowed, so random weights would write keys until the budget ends; the
    # output closes in time instead, every time.
    for seed in range(8):
        result = engine.generate(
            "Answer in JSON.", max_new_tokens=48, temperature=1.0, seed=seed, constraint=OutputConstraint.any_json_object()
        )
        assert result.finish_reason == "eos", result.output_text
        assert result.generated_tokens <= 48
        assert isinstance(json.loads(result.output_text), dict)


def test_grammar_constraint_limits_output_to_its_language(engine, device):
    grammar = 'start: "yes" | "no" | "maybe later"'
    outputs = {
        engine.generate("Is it?", max_new_tokens=16, temperature=1.0, seed=seed, constraint={"grammar": grammar}).output_text
        for seed in range(8)
    }
    assert outputs <= {"yes", "no", "maybe later"}
    assert outputs


def test_stream_gives_the_same_text_as_generate(engine, device):
    options = GenerationOptions(max_new_tokens=64, constraint=OutputConstraint(json_schema=Lookup.model_json_schema()))
    stream = engine.stream("Look something up.", options)
    text = "".join(stream)
    assert text == engine.generate("Look something up.", options).output_text == stream.result.output_text


def test_budget_below_the_minimum_is_refused_before_prefill(engine, device):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    with pytest.raises(InvalidInputError, match=r"max_new_tokens=8 is below the (\d+) tokens") as refused:
        engine.stream("Write.", max_new_tokens=8, constraint={"json_schema": schema})
    assert engine._places.admitted == 0
    minimum = int(re.search(r"below the (\d+) tokens", str(refused.value)).group(1))
    assert minimum > 8 and engine.min_new_tokens({"json_schema": schema}) == minimum
    result = engine.generate("Write.", max_new_tokens=minimum, temperature=1.0, seed=0, constraint={"json_schema": schema})
    assert result.finish_reason == "eos"
    assert len(json.loads(result.output_text)["text"]) >= 40


def test_a_grammar_with_no_closing_path_is_cut_and_warns(engine, caplog, monkeypatch):
    # The closing walk cannot satisfy this pattern byte by byte: no minimum, no closing; the
    # budget cuts the output and the warning says so.
    monkeypatch.setattr(engine_module, "_warnings", RateLimitedLogger(engine_module.logger))
    schema = {"type": "object", "properties": {"text": {"type": "string", "pattern": "^a+(bc)+d$"}}, "required": ["text"]}
    assert engine._constraints.compile(OutputConstraint(json_schema=schema), 8).minimum_tokens is None
    assert engine.min_new_tokens(OutputConstraint(json_schema=schema)) is None
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        result = engine.generate("Write.", max_new_tokens=8, constraint={"json_schema": schema})
    assert result.generated_tokens == 8
    if result.finish_reason == "length":  # (the tiny model's greedy text is not known here)
        assert result.output_text.startswith('{"text": "')
        assert "raise max_new_tokens" in caplog.text


@pytest.mark.parametrize(
    ("constraint", "match"),
    [
        ({"json_schema": {"type": "objectx"}}, "invalid JSON schema.*objectx"),
        ({"json_schema": {"$ref": "#/$defs/Missing"}}, "invalid JSON schema"),
        ({"grammar": "start: undefined_rule"}, "invalid grammar"),
        ({"json_schema": {"type": "object"}, "grammar": 'start: "x"'}, "exactly one"),
        ({}, "exactly one"),
        ({"grammar": "  "}, "grammar is empty"),
    ],
)
def test_bad_constraints_are_rejected_before_decoding(engine, constraint, match):
    with pytest.raises(InvalidInputError, match=match):
        engine.stream("Hello.", constraint=constraint)


def test_constraint_leaves_prefill_and_reuse_untouched(make_engine, docs, device):
    # Two engines in the same state: one prompt decoded freely and under a constraint.
    engines = [make_engine("llama"), make_engine("llama")]
    for engine in engines:
        engine.warm(SYSTEM_PROMPT)
        engine.warm_documents(docs[:2])
    prompt = f"{SYSTEM_PROMPT}\n\n{docs[1]}\n\n{docs[0]}\n\nQuestion: which?"
    schema = Lookup.model_json_schema()
    free = engines[0].generate(prompt, max_new_tokens=4, return_logits=True)
    constrained = engines[1].generate(prompt, max_new_tokens=96, return_logits=True, constraint={"json_schema": schema})
    assert constrained.prefix_hit_tokens > 0
    assert constrained.content_hit_tokens > 0
    assert torch.equal(free.first_token_logits, constrained.first_token_logits)
    Lookup.model_validate_json(constrained.output_text)


class _OnlyToken:
    """A guide allowing one token, recording what it was told."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.advanced: list[int] = []

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(logits, float("-inf"))
        masked[self.token] = logits[self.token]
        return masked

    def advance(self, token: int) -> bool:
        self.advanced.append(token)
        return True


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_next_token_applies_the_guide_before_sampling(temperature):
    logits = torch.arange(10, dtype=torch.float32)  # greedy alone would pick 9
    guide = _OnlyToken(3)
    options = GenerationOptions(temperature=temperature, seed=0)
    assert next_token(logits, options, SequenceSampling(torch.Generator().manual_seed(0), guide)) == 3
    assert guide.advanced == [3]


def test_next_token_without_guide_is_plain_sampling():
    logits = torch.arange(10, dtype=torch.float32)
    assert next_token(logits, GenerationOptions(), SequenceSampling()) == 9


def test_repetition_penalty_lowers_generated_tokens_only():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    options = GenerationOptions(repetition_penalty=2.0)
    state = SequenceSampling(generated=[0, 1])
    # Token 2 is greedy anyway; the generated tokens' logits are lowered (positive halved,
    # negative doubled), the others untouched.
    assert next_token(logits, options, state) == 2
    assert state.generated == [0, 1, 2]
    from kvboost_rag.decode.sampling import penalize_repeats

    assert penalize_repeats(logits, [0, 1, 0], 2.0).tolist() == [1.0, -2.0, 3.0, 0.5]
    flipped = torch.tensor([3.0, 2.5])
    assert next_token(flipped, options, SequenceSampling(generated=[0])) == 1  # 3/2 < 2.5


def test_repetition_penalty_is_validated(engine):
    with pytest.raises(InvalidInputError, match="repetition_penalty"):
        engine.generate("Hello.", repetition_penalty=0.5)
    assert engine.generate("Hello.", max_new_tokens=8, repetition_penalty=1.3).generated_tokens <= 8


def test_batched_and_concurrent_decoding_apply_each_sequences_constraint(make_engine, device):
    # Every sequence of a batch decodes under its own constraint state: each output is valid
    # for the schema and equals the same prompt decoded alone.
    engine = make_engine("llama")
    schema = {"json_schema": Lookup.model_json_schema()}
    prompts = ["Look something up.", "Find the tutorial on loops.", "Search the library reference."]
    alone = [engine.generate(p, max_new_tokens=96, constraint=schema) for p in prompts]
    batch = engine.generate_batch(prompts, max_new_tokens=96, constraint=schema)
    for single, batched in zip(alone, batch):
        assert not isinstance(batched, Exception), batched
        assert batched.finish_reason == "eos", batched.output_text
        Lookup.model_validate_json(batched.output_text)
        assert batched.token_ids == single.token_ids


def test_a_bad_constraint_fails_the_whole_batch_before_any_prefill(make_engine):
    engine = make_engine("llama")
    with pytest.raises(InvalidInputError):
        engine.generate_batch(["Look something up.", "Again."], constraint={"json_schema": {"type": "no-such-type"}})
    assert engine._places.admitted == 0


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_bitmask_forbids_exactly_the_tokens_whose_bit_is_clear(vocab, device):
    llguidance_torch = pytest.importorskip("llguidance.torch")
    generator = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(vocab, generator=generator) < 0.3
    allowed[-1] = True  # the top bit of the last word, the sign bit when vocab % 32 == 0
    bitmask = llguidance_torch.allocate_token_bitmask(1, vocab)[0]
    bitmask.zero_()
    for token in allowed.nonzero().flatten().tolist():
        word, bit = divmod(token, 32)
        bitmask[word] = int(bitmask[word]) | (1 << bit) if bit < 31 else int(bitmask[word]) - 2**31
    logits = torch.randn(vocab, generator=generator, dtype=torch.bfloat16).to(device)
    masked = masked_by_bitmask(logits, bitmask)  # the bitmask stays on the host, as llguidance fills it
    assert masked.dtype == logits.dtype and masked.device == logits.device
    allowed = allowed.to(device)
    assert torch.equal(masked[allowed], logits[allowed])
    assert torch.isneginf(masked[~allowed]).all()
    wider = masked_by_bitmask(torch.zeros(vocab + 5, device=device), bitmask)
    assert torch.isneginf(wider[vocab:]).all()


def test_min_new_tokens_validates_the_constraint(engine):
    with pytest.raises(InvalidInputError, match="constraint"):
        engine.min_new_tokens({"json_schema": {"type": "object"}, "grammar": "start: /a/"})
