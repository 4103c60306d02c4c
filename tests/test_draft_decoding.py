"""Draft-and-verify decoding: the tokens plain decoding gives, drafted or not.

Greedy decoding with drafts must give plain greedy decoding's tokens (a difference only where
plain decoding's two best logits tie within float rounding), alone and batched, with stop
strings, budgets, constraints and returned logits; sampling must keep its distribution; the
K/V rows written for rejected drafts must never be read. Draft lengths are set by measured step
times in real use; here the policy drafts everything it is offered (``always_draft``), whatever
the machine's timing. Random tiny models rarely quote their prompts, so most tests draft from
an oracle (``oracle_drafts``): the plain greedy answer itself, with a wrong token planted in
every other draft and draft lengths that vary from step to step, so every step verifies,
accepting some drafted tokens and rejecting others. The real drafter runs on the embedded
model, which does quote its documents.
"""

from __future__ import annotations

import math

import pytest
import torch
from decoding_checks import margins
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost
from kvboost_rag.decode.draft_policy import DraftPolicy
from kvboost_rag.decode.drafting import Proposal
from kvboost_rag.generation import request_work
from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler
from kvboost_rag.decode.step import DecodeSequence, decode_step
from kvboost_rag.decode_weights.small_rows import onednn_available
from kvboost_rag.request.options import GenerationOptions

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "stablelm", "gpt2")
#: Near ties: plain decoding's top-1 margin within this may go either way on another kernel path.
TIE = 1e-4


@pytest.fixture
def always_draft(monkeypatch):
    """Draft every token the drafter proposes (up to the setting), whatever steps cost."""
    monkeypatch.setattr(DraftPolicy, "length", lambda self, sequence, source, match, available, rows: min(available, self.max_tokens))


class OracleDrafter:
    """Drafts from a known answer: ``answer[n:]`` after ``n`` tokens, 1-5 tokens long, with a
    wrong token in the middle of every other draft."""

    def __init__(self, answer: list[int], vocab: int) -> None:
        self.answer, self.vocab, self.produced, self.proposals = answer, vocab, 0, 0

    def accept(self, tokens) -> None:
        self.produced += len(tokens)

    def propose(self, limit: int) -> Proposal | None:
        n = self.produced
        tokens = list(self.answer[n : n + min(limit, 1 + n % 5)])
        if not tokens:
            return None
        self.proposals += 1
        if self.proposals % 2 == 0:
            middle = len(tokens) // 2
            tokens[middle] = (tokens[middle] + 1) % self.vocab
        return Proposal(tokens, 4, "document")


@pytest.fixture
def oracle_drafts(monkeypatch, always_draft):
    """``answers[prompt] = token ids``: each generate of that prompt drafts from them."""
    answers: dict[str, list[int]] = {}

    def drafter(plan):
        return OracleDrafter(answers.get(plan.tokens.text, []), 1024)

    monkeypatch.setattr(request_work, "drafter_for", drafter)
    return answers


def _repetitive_prompt(docs: list[str]) -> str:
    """A prompt whose documents repeat a sentence (so document drafts exist) and a question."""
    refrain = "The pass statement does nothing; it is used where a statement is required. "
    return rag_prompt([docs[0], refrain * 4, docs[1]], "What does pass do? Repeat the rule.")


def _engine(make_engine, family: str, docs: list[str], **settings) -> KVBoost:
    # Every run of a prompt sees the cache its reference saw: a prompt's own blocks, stored by
    # one run, would be served by content (approximately) to the next.
    settings.setdefault("store_prompt_blocks", False)
    engine = make_engine(family, **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:2])
    return engine


def assert_same_greedy(drafted: list[int], plain: list[int], plain_logits: torch.Tensor) -> None:
    """``drafted`` equals ``plain`` up to plain decoding's first near tie."""
    for step, margin in enumerate(margins(plain_logits)):
        if step >= len(plain) or margin <= TIE:
            return
        assert step < len(drafted) and drafted[step] == plain[step], f"step {step}: {drafted[step:]} vs {plain[step:]}"
    assert len(drafted) == len(plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_plain_greedy_decodings_alone_and_batched(make_engine, docs, family, oracle_drafts, device):
    prompts = [_repetitive_prompt(docs), rag_prompt([docs[1], docs[0]], "Summarize."), SYSTEM_PROMPT + "\n\nQuestion: hi?\nAnswer:"]
    plain = _engine(make_engine, family, docs, draft_tokens=0)
    drafted = _engine(make_engine, family, docs)
    references = [plain.generate(p, max_new_tokens=40, return_logits=True) for p in prompts]
    oracle_drafts.update({p: r.token_ids for p, r in zip(prompts, references)})
    alone = [drafted.generate(p, max_new_tokens=40) for p in prompts]
    batched = _engine(make_engine, family, docs).generate_batch(prompts, max_new_tokens=40)
    for reference, one, batch in zip(references, alone, batched):
        assert reference.drafted_tokens == 0
        for run in (one, batch):
            assert_same_greedy(run.token_ids, reference.token_ids, reference.step_logits)
            # Every token is the first token, a step's own token, or an accepted draft.
            if run.token_ids == reference.token_ids and run.finish_reason == "length":
                assert run.generated_tokens == 1 + run.decode_steps + run.drafted_tokens
    for run in (*alone, *batched):
        assert run.drafted_tokens > 0 and run.draft_steps >= run.decode_steps - 1  # each step but the last verified a draft


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma2", "gemma3_text"])
def test_greedy_tokens_stay_plain_greedy_decodings_on_the_packed_small_row_kernel(make_engine, docs, family, oracle_drafts):
    """On tiny models ``"auto"`` keeps ``F.linear`` (oneDNN's call costs more than such layers'
    product): the kernel real models get is forced here, with drafts, against plain decoding on
    the model's own product."""
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    prompts = [_repetitive_prompt(docs), rag_prompt([docs[1], docs[0]], "Summarize.")]
    plain = _engine(make_engine, family, docs, draft_tokens=0, small_row_kernels="off")
    references = [plain.generate(p, max_new_tokens=40, return_logits=True) for p in prompts]
    oracle_drafts.update({p: r.token_ids for p, r in zip(prompts, references)})
    packed = _engine(make_engine, family, docs, small_row_kernels="packed")
    assert packed.small_row_kernel == "packed" and plain.small_row_kernel == "off"
    alone = [packed.generate(p, max_new_tokens=40, return_logits=True) for p in prompts]
    batched = packed.generate_batch(prompts, max_new_tokens=40)
    for reference, one, batch in zip(references, alone, batched):
        assert one.drafted_tokens > 0 and batch.drafted_tokens > 0
        assert_same_greedy(one.token_ids, reference.token_ids, reference.step_logits)
        assert_same_greedy(batch.token_ids, reference.token_ids, reference.step_logits)
        steps = min(len(one.token_ids), len(reference.token_ids))
        if one.token_ids[:steps] == reference.token_ids[:steps]:
            torch.testing.assert_close(one.step_logits[:steps], reference.step_logits[:steps], atol=1e-4, rtol=1e-4)


def test_stop_strings_budgets_and_returned_logits_match_plain_decoding(make_engine, docs, oracle_drafts, device):
    prompt = _repetitive_prompt(docs)
    plain = _engine(make_engine, "llama", docs, draft_tokens=0)
    drafted = _engine(make_engine, "llama", docs)
    reference = plain.generate(prompt, max_new_tokens=40, return_logits=True)
    oracle_drafts[prompt] = reference.token_ids
    run = drafted.generate(prompt, max_new_tokens=40, return_logits=True)
    assert run.drafted_tokens > 0
    assert run.token_ids == reference.token_ids
    assert run.step_logits.shape == reference.step_logits.shape
    torch.testing.assert_close(run.step_logits, reference.step_logits, atol=1e-4, rtol=1e-4)
    # A stop string that ends inside what a verify step accepted, and budgets of every size.
    stop = reference.output_text[len(reference.output_text) // 2 :][:6]
    assert stop.strip()
    for options in ({"stop": [stop]}, {"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 7}):
        options = {"max_new_tokens": 40, **options}
        expected = plain.generate(prompt, **options)
        got = drafted.generate(prompt, **options)
        assert (got.token_ids, got.output_text, got.finish_reason) == (expected.token_ids, expected.output_text, expected.finish_reason)


def test_streamed_pieces_are_the_text_as_drafts_are_accepted(make_engine, docs, oracle_drafts):
    prompt = _repetitive_prompt(docs)
    expected = _engine(make_engine, "qwen3", docs, draft_tokens=0).generate(prompt, max_new_tokens=40)
    oracle_drafts[prompt] = expected.token_ids
    stream = _engine(make_engine, "qwen3", docs).stream(prompt, max_new_tokens=40)
    pieces = list(stream)
    assert "".join(pieces) == expected.output_text
    assert stream.result.drafted_tokens > 0


def test_constrained_drafts_hold_only_tokens_the_guide_allows(make_engine, docs, oracle_drafts, monkeypatch):
    from kvboost_rag.decode.constrained import GrammarGuide

    cut: list[tuple[int, int]] = []
    valid_prefix = GrammarGuide.valid_prefix

    def recording(self, tokens):
        allowed = valid_prefix(self, tokens)
        cut.append((len(tokens), allowed))
        return allowed

    monkeypatch.setattr(GrammarGuide, "valid_prefix", recording)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    prompt = _repetitive_prompt(docs)
    plain = _engine(make_engine, "llama", docs, draft_tokens=0).generate(prompt, max_new_tokens=30, constraint={"json_schema": schema})
    oracle_drafts[prompt] = plain.token_ids
    drafted = _engine(make_engine, "llama", docs).generate(prompt, max_new_tokens=30, constraint={"json_schema": schema})
    assert drafted.token_ids == plain.token_ids
    assert cut and any(allowed < proposed for proposed, allowed in cut), "no draft was cut by the grammar"


def _sequence(engine: KVBoost, prompt: str, budget: int, **options) -> DecodeSequence:
    """A prefilled sequence of ``prompt`` whose first token is chosen (greedy unless told)."""
    requests = engine._requests
    tokens = requests.tokenizing.prompt(prompt)
    opts = GenerationOptions(max_new_tokens=budget, **options)
    plan = requests.planner.plan(tokens, find_documents=False, content_reuse=False, reserve=budget)
    outcome = requests.prefiller.run(plan, reuse=False)
    generator = None
    if "seed" in options:
        generator = torch.Generator().manual_seed(options["seed"])
    sequence = DecodeSequence(
        cache=outcome.cache, position=len(tokens), budget=budget, options=opts,
        sampling=SequenceSampling(generator), assembler=TextAssembler(engine.tokenizer), eos_ids=frozenset(),
    )
    sequence.choose(outcome.logits)
    return sequence


def test_rows_of_rejected_drafts_never_reach_attention(make_engine, docs):
    engine = make_engine("llama", draft_tokens=0)
    adapter = engine._adapter
    prompt = rag_prompt([docs[0]])
    reference = _sequence(engine, prompt, 24)
    for _ in range(12):
        decode_step(adapter, [reference])
    sequence = _sequence(engine, prompt, 24)
    wrong = [(t + 1) % 100 for t in reference.sampling.generated[1:9]]  # drafts the model rejects at once
    sequence.make_drafter = lambda: _FixedDrafter(wrong)
    policy = DraftPolicy(engine.settings.model_copy(update={"draft_tokens": 8}), "cpu")
    policy.length = lambda *args: 8
    position = sequence.position
    decode_step(adapter, [sequence], policy)
    assert sequence.drafts.draft_steps == 1 and sequence.drafts.drafted_tokens == 0
    assert sequence.position == position + 1
    keys, values = adapter.cache_tensors(sequence.cache)
    assert keys.shape[2] == sequence.position  # the rejected rows are no longer part of the cache
    buffer = sequence.cache.layers[0]._key_buffer
    for layer in sequence.cache.layers:  # poison every row past the kept ones
        layer._key_buffer[..., sequence.position :, :] = float("nan")
        layer._value_buffer[..., sequence.position :, :] = float("nan")
    assert sequence.cache.layers[0]._key_buffer is buffer
    while len(sequence.sampling.generated) < len(reference.sampling.generated):
        decode_step(adapter, [sequence])
    assert sequence.sampling.generated == reference.sampling.generated


class _FixedDrafter:
    """Proposes ``tokens`` once (a drafter whose draft the test chooses)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def accept(self, tokens) -> None:
        pass

    def propose(self, limit: int):
        tokens, self.tokens = self.tokens[:limit], []
        return Proposal(tokens, 4, "document") if tokens else None


def test_the_acceptance_rule_keeps_the_sampling_distribution():
    """A point-mass draft accepted as the model's own sample keeps the model's distribution: over
    many seeds the first token's frequencies match its probabilities and the draft is accepted
    with the model's probability of it (bounds of 6 standard deviations: a failure by chance has
    a probability below 1e-8)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    probs = torch.softmax(logits[0], dim=-1)
    draft = [int(torch.argsort(probs)[2]), 1]  # a middling token
    options = GenerationOptions(max_new_tokens=8, temperature=1.0)
    runs = 3000
    counts = torch.zeros(6)
    accepted = 0
    for seed in range(runs):
        sequence = DecodeSequence(
            cache=_NoCache(), position=10, budget=8, options=options,
            sampling=SequenceSampling(torch.Generator().manual_seed(seed)), assembler=_Assembler(), eos_ids=frozenset(),
        )
        _, taken = sequence.verify(logits, draft)
        counts[sequence.sampling.generated[0]] += 1
        accepted += taken >= 1
        assert sequence.position == 10 + taken + 1
    for token in range(6):
        p = float(probs[token])
        assert abs(counts[token] / runs - p) <= 6 * math.sqrt(p * (1 - p) / runs), token
    p = float(probs[draft[0]])
    assert abs(accepted / runs - p) <= 6 * math.sqrt(p * (1 - p) / runs)


def test_seeded_sampling_draws_what_plain_sampling_draws(make_engine, docs, oracle_drafts):
    prompt = _repetitive_prompt(docs)
    plain = _engine(make_engine, "llama", docs, draft_tokens=0)
    drafted = _engine(make_engine, "llama", docs)
    same, drafts = 0, 0
    for seed in range(12):
        options = {"max_new_tokens": 24, "temperature": 0.7, "seed": seed}
        a = plain.generate(prompt, **options)
        oracle_drafts[prompt] = a.token_ids
        b = drafted.generate(prompt, **options)
        same += a.token_ids == b.token_ids
        drafts += b.drafted_tokens
    assert drafts > 0
    # Each token is one draw from the same distribution with the same generator; a draw that
    # lands within float rounding of a boundary may differ on another kernel path.
    assert same >= 10


class _NoCache:
    layers: list = []

    def truncate(self, length: int) -> None:
        pass


class _Assembler:
    stopped = False

    def add(self, token: int) -> str:
        return ""

    def finish(self) -> str:
        return ""
