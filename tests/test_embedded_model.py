"""The real embedded model (SmolLM2-135M-Instruct): reuse quality on shuffled RAG prompts."""

import random
import statistics

import pytest
from decoding_checks import check_against_full_prefill, margins
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost, KVBoostSettings
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.diagnosis.correctness import first_token_kl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stored_engine():
    """The embedded model decoding on its GGUF's 4-bit runs as stored (``decode_weights="stored"``)."""
    return KVBoost.from_pretrained(show_progress=False, warm_prefix=SYSTEM_PROMPT + "\n\n", decode_weights="stored")


@pytest.fixture(scope="module")
def corpus():
    return python_reference_documents(max_chars=900)[10:18]


def test_embedded_model_loads_with_chat_template(embedded_engine):
    assert embedded_engine.model.config.model_type == "llama"
    assert embedded_engine.context_window == 8192
    text = embedded_engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")


def test_repairs_beat_no_repair_on_shuffled_documents(embedded_engine, corpus):
    engine = embedded_engine
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(corpus)
    rng = random.Random(7)
    kl = {"none": [], "cacheblend": [], "attention": []}
    for i in range(3):
        prompt = rag_prompt(rng.sample(corpus, 4), question=f"What is rule number {i}?")
        full = engine.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
        for strategy in kl:
            engine.settings.recompute_strategy = strategy
            engine.settings.recompute_ratio = 0.15
            res = engine.generate(prompt, max_new_tokens=1, return_logits=True)
            # A prompt that starts with a context document hits it as part of the prefix.
            assert res.prefix_hit_tokens + res.content_hit_tokens > 0.8 * res.prompt_tokens - 40
            kl[strategy].append(first_token_kl(full.first_token_logits, res.first_token_logits))
    engine.settings.recompute_strategy = "attention"
    assert statistics.mean(kl["cacheblend"]) < statistics.mean(kl["none"])
    # Recomputing what the last token attends to: below no repair on every prompt, and below
    # CacheBlend's deviation-chosen tokens at the same budget.
    assert all(a < n for a, n in zip(kl["attention"], kl["none"]))
    assert statistics.mean(kl["attention"]) < statistics.mean(kl["cacheblend"])


def test_prefix_hit_is_exact_on_the_embedded_model(embedded_engine, corpus):
    engine = embedded_engine
    prefix = SYSTEM_PROMPT + "\n\n" + "\n\n".join(corpus[:2]) + "\n\n"
    engine.warm(prefix)
    prompt = prefix + "Question: what is described?\nAnswer:"
    full = engine.generate(prompt, max_new_tokens=12, reuse=False, return_logits=True)
    check = check_against_full_prefill(engine, prompt, full, atol=1e-3)
    assert check.steps_compared > 0
    for hit in (check.forced, check.free):
        assert hit.prefix_hit_tokens >= engine.count_tokens(prefix) - 1


def test_a_prefix_hits_first_token_is_exact_while_decode_reads_four_bit_runs(stored_engine, corpus):
    """Prompt work beside decode rows (the tokens after a prefix hit) reads the model's own
    weights whatever decode reads: the first token's logits are full prefill's."""
    prefix = SYSTEM_PROMPT + "\n\n" + "\n\n".join(corpus[2:4]) + "\n\n"
    stored_engine.warm(prefix)
    prompt = prefix + "Question: what is described?\nAnswer:"
    full = stored_engine.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
    hit = stored_engine.generate(prompt, max_new_tokens=1, return_logits=True)
    assert hit.prefix_hit_tokens >= stored_engine.count_tokens(prefix) - 1
    assert (hit.step_logits[0].float() - full.step_logits[0].float()).abs().max() <= 1e-3


@pytest.mark.parametrize("weighting", ["attention", "value"])
def test_attention_repair_beats_no_repair_and_improves_with_budget(embedded_engine, corpus, weighting):
    """Every prompt: each budget below no repair; the mean KL falls as the budget grows."""
    engine = embedded_engine
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(corpus)
    rng = random.Random(11)
    budgets = (0.0, 0.05, 0.10, 0.20)
    kl: dict[float, list[float]] = {b: [] for b in budgets}
    try:
        for i in range(3):
            prompt = rag_prompt(rng.sample(corpus, 4), question=f"Which rule applies to case {i}?")
            full = engine.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
            for budget in budgets:
                engine.settings.recompute_strategy = "attention" if budget else "none"
                engine.settings.recompute_ratio = budget
                engine.settings.probe_weighting = weighting
                res = engine.generate(prompt, max_new_tokens=1, return_logits=True)
                kl[budget].append(first_token_kl(full.first_token_logits, res.first_token_logits))
    finally:
        engine.settings.recompute_strategy = "attention"
        engine.settings.probe_weighting = KVBoostSettings().probe_weighting
        engine.settings.recompute_ratio = KVBoostSettings().recompute_ratio
    for budget in budgets[1:]:
        assert all(k < none for k, none in zip(kl[budget], kl[0.0])), (budget, kl)
    means = [statistics.mean(kl[b]) for b in budgets]
    assert means == sorted(means, reverse=True), means


def test_decode_reads_the_stored_four_bit_runs_and_answers_as_the_own_weights_do(embedded_engine, stored_engine):
    """The embedded model's GGUF stores its 210 projection layers as Q4_1: decode reads them as
    stored, and its greedy answer is the float32 weights' up to their first near tie (a top-1
    margin under 0.5, the bar ``bench/int8_quality.py`` measures)."""
    from kvboost_rag.decode_weights.four_bit_groups import four_bit_available

    if not four_bit_available():
        pytest.skip("no CPU 4-bit kernel in this torch build")
    assert stored_engine.four_bit_layers == 210
    own = embedded_engine  # the default: its own float32 weights
    assert own.four_bit_layers == 0
    topics = python_reference_documents(max_chars=700)[:3]
    prompt = own.apply_chat_template(
        [{"role": "user", "content": "\n\n".join(topics) + "\n\nExplain the first document in two sentences."}]
    )
    # Computed whole: the engines are shared with other tests, whose cached K/V a lookup would
    # read (approximate reuse after another file's tests changed the own engine's answer).
    expected = own.generate(prompt, max_new_tokens=32, reuse=False, return_logits=True)
    got = stored_engine.generate(prompt, max_new_tokens=32, reuse=False)
    for step, margin in enumerate(margins(expected.step_logits)):
        if margin < 0.5:
            break
        assert got.token_ids[step] == expected.token_ids[step], step
