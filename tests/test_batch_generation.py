"""generate_batch: every prompt prefilled with its own reuse, all decoded together (on the CPU,
and on CUDA where the rows' attention runs as one padded call)."""

from __future__ import annotations

import time

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag import KVBoost
from kvboost_rag.decode.sampling import SequenceSampling, TextAssembler
from kvboost_rag.decode.step import DecodeSequence
from kvboost_rag.dev.testing import ROPE_FAMILIES, tiny_model
from kvboost_rag.errors import InvalidInputError, PromptTooLongError

from devices import engine_device_settings
from loop_hooks import on_decode_rows, record_decode_sizes

# Llama-style RoPE, Qwen2 (biases), a partial-rotary family, interleaved sliding-window
# layers, and GPT-2 (no RoPE: prefix-only reuse).
FAMILIES = ("llama", "qwen2", "stablelm", "gemma2", "gpt2")


def _prompts(docs: list[str]) -> list[str]:
    """RAG prompts of different lengths (1-3 documents), and one with no document."""
    return [
        rag_prompt([docs[2], docs[0]]),
        rag_prompt([docs[1]], "Which keyword is it about?"),
        rag_prompt([docs[3], docs[1], docs[0]], "Summarize."),
        SYSTEM_PROMPT + "\n\nQuestion: what is a tuple?\nAnswer:",
    ]


def _warmed(make_engine, family: str, docs: list[str], **settings) -> KVBoost:
    engine = make_engine(family, **settings)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    return engine


def _same(alone, batched) -> None:
    """Same output and the same per-prompt reuse figures; the exact prefix hit may be longer
    in a batch (a beginning the prompts share is computed once and read by each)."""
    assert batched.token_ids == alone.token_ids
    assert batched.output_text == alone.output_text
    assert batched.finish_reason == alone.finish_reason
    for name in ("prompt_tokens", "content_hit_tokens", "recomputed_tokens", "documents_found"):
        assert getattr(batched, name) == getattr(alone, name), name
    assert batched.prefix_hit_tokens >= alone.prefix_hit_tokens
    assert batched.cached_tokens - batched.prefix_hit_tokens == alone.cached_tokens - alone.prefix_hit_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_gives_each_prompt_its_greedy_output_alone(make_engine, docs, family, device):
    prompts = _prompts(docs)
    # Each prompt alone on an engine in the state the batch starts from (one engine per
    # prompt: a generate stores what its prompt taught, which would change the next one's reuse).
    alone = [_warmed(make_engine, family, docs).generate(p, max_new_tokens=12) for p in prompts]
    engine = _warmed(make_engine, family, docs)
    sizes = record_decode_sizes(engine)
    batched = engine.generate_batch(prompts, max_new_tokens=12)
    assert len(batched) == len(prompts)
    for a, b in zip(alone, batched):
        _same(a, b)
    assert max(sizes) == len(prompts), "the batch's prompts never decoded in one step together"
    if family != "gpt2":
        assert batched[0].content_hit_tokens > 0  # document reuse really ran
    assert all(b.prefix_hit_tokens > 0 for b in batched)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_shared_beginning_is_computed_once_for_the_batch(make_engine, docs, family, device):
    beginning = SYSTEM_PROMPT + "\n\n" + docs[4] + "\n\n"  # never warmed
    prompts = [beginning + f"Question: what is a {word}?\nAnswer:" for word in ("list", "tuple", "set")]
    alone = [make_engine(family).generate(p, max_new_tokens=8) for p in prompts]
    assert all(a.prefix_hit_tokens == 0 for a in alone)
    engine = make_engine(family)
    batched = engine.generate_batch(prompts, max_new_tokens=8)
    shared = len(engine.tokenizer(beginning)["input_ids"]) - 2  # the last tokens may merge with the question
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids
        assert b.prefix_hit_tokens >= shared and b.live_tokens == b.prompt_tokens - b.prefix_hit_tokens
    engine.flush()  # every queued write counted, however slow the machine
    stored = engine.cache_stats().counters["stored_entries"]
    engine.generate_batch(prompts, max_new_tokens=2)  # stored already: nothing computed or stored again
    engine.flush()
    assert engine.cache_stats().counters["stored_entries"] == stored


def test_ttft_and_total_are_from_the_call(make_engine, docs):
    engine = _warmed(make_engine, "llama", docs)
    start = time.perf_counter()
    results = engine.generate_batch(_prompts(docs), max_new_tokens=6)
    wall_ms = (time.perf_counter() - start) * 1000
    assert all(0 < r.ttft_ms <= r.total_ms <= wall_ms for r in results)


def test_finished_sequences_leave_the_batch(tokenizer, docs, device):
    short = "Question: what is a list?\nAnswer:"
    long = docs[0][:300] + "\n\nQuestion: what?\nAnswer:"
    n_long = len(tokenizer(long)["input_ids"])
    # A context window that leaves the long prompt 6 new tokens; the short one gets 20.
    model = tiny_model("llama", max_position_embeddings=n_long + 6)
    engine = KVBoost.from_model(model, tokenizer, show_progress=False, chunk_size=32, **engine_device_settings(device))
    sizes = record_decode_sizes(engine)
    long_result, short_result = engine.generate_batch([long, short], max_new_tokens=20)
    assert (long_result.finish_reason, long_result.generated_tokens) == ("length", 6)
    assert (short_result.finish_reason, short_result.generated_tokens) == ("length", 20)
    # Both prefill in the first step (within its prompt budget) and decode from the next; the
    # long prompt leaves after its 5 steps, the short one goes on.
    assert sizes == [2] * 5 + [1] * 14


def test_stop_strings_apply_per_sequence(make_engine, docs, device):
    prompts = _prompts(docs)
    engine = _warmed(make_engine, "llama", docs)
    free = engine.generate_batch(prompts, max_new_tokens=16, reuse=False)
    # A stop string taken from the middle of the first output: only prompts whose output holds it stop.
    stop = free[0].output_text[4:7]
    assert stop.strip()
    stopped = _warmed(make_engine, "llama", docs).generate_batch(prompts, max_new_tokens=16, reuse=False, stop=[stop])
    for before, after in zip(free, stopped):
        if stop in before.output_text:
            assert after.finish_reason == "stop"
            assert after.output_text == before.output_text[: before.output_text.index(stop)]
        else:
            assert after.output_text == before.output_text and after.finish_reason == before.finish_reason
    assert stopped[0].finish_reason == "stop"


def test_bad_prompts_fail_alone(make_engine, docs, device):
    engine = _warmed(make_engine, "llama", docs)
    good = _prompts(docs)[:2]
    too_long = "word " * 5000
    results = engine.generate_batch([good[0], "", too_long, "bad \ud800 text", good[1], 42], max_new_tokens=6)
    assert isinstance(results[1], InvalidInputError) and "prompt 1" in str(results[1])
    assert isinstance(results[2], PromptTooLongError) and "context window" in str(results[2])
    assert isinstance(results[3], InvalidInputError) and "surrogate" in str(results[3])
    assert isinstance(results[5], InvalidInputError) and "prompt 5" in str(results[5])
    reference = [_warmed(make_engine, "llama", docs).generate(p, max_new_tokens=6) for p in good]
    _same(reference[0], results[0])
    _same(reference[1], results[4])


def test_batch_level_mistakes_raise(make_engine):
    engine = make_engine("llama")
    with pytest.raises(InvalidInputError, match="not one string"):
        engine.generate_batch("one prompt")
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        engine.generate_batch(["a prompt"], max_new_tokens=0)
    assert engine.generate_batch([]) == []


def test_a_failing_sequence_ends_alone(make_engine, docs):
    engine = _warmed(make_engine, "llama", docs)
    prompts = _prompts(docs)
    reference = [_warmed(make_engine, "llama", docs).generate(p, max_new_tokens=8) for p in prompts]

    class Boom(RuntimeError):
        pass

    armed = []

    def arm(rows):
        # The second sequence of the first shared step fails choosing its token.
        if not armed and len(rows.sequences) > 1:
            target = rows.sequences[1]
            armed.append(target)

            def take(token):
                raise Boom("token choice failed")

            target.take = take

    on_decode_rows(engine, arm)
    results = engine.generate_batch(prompts, max_new_tokens=8)
    failed = [r for r in results if isinstance(r, Boom)]
    assert len(failed) == 1
    for ref, result in zip(reference, results):
        if not isinstance(result, Boom):
            _same(ref, result)
    assert engine._places.admitted == 0


def test_decode_sequence_ends_on_eos_stop_and_budget(tokenizer):
    def sequence(budget=5, stop=()):
        return DecodeSequence(
            cache=None, position=0, budget=budget, options=None, sampling=SequenceSampling(),
            assembler=TextAssembler(tokenizer, stop), eos_ids=frozenset({2}),
        )

    ids = tokenizer("the list and the tuple", add_special_tokens=False)["input_ids"]
    s = sequence()
    assert s.take(ids[0]) and s.token == ids[0] and not s.done
    assert s.take(2) == [] and s.finish_reason == "eos" and s.produced == 1
    s = sequence(budget=2)
    s.take(ids[0])
    s.take(ids[1])
    assert s.finish_reason == "length" and s.assembler.text == tokenizer.decode(ids[:2])
    s = sequence(stop=["tuple"])
    pieces: list[str] = []
    for token in ids:
        pieces += s.take(token)
        if s.done:
            break
    assert s.finish_reason == "stop" and "".join(pieces) == s.assembler.text == "the list and the "


@pytest.mark.parametrize("one_call", [False, True])
def test_a_packed_pass_gives_each_segment_what_its_own_pass_gives(make_engine, one_call, device):
    """One packed pass over caches of different lengths (decode rows of one and three tokens,
    a prompt slice appended to a cache, a slice scattered into a cache that holds every
    position) gives each segment the logits, and leaves each cache with the K/V, of a pass of
    that segment alone through the model's own or the sparse attention (sliding-window layers
    included), whether the short rows attend one call per row (CPU's default) or in one padded
    call (CUDA's)."""
    from kvboost_rag.hf.packed import Segment
    from kvboost_rag.attention_backends.ragged import one_call as attention_in_one_call

    for family in (*ROPE_FAMILIES, "gpt2"):
        adapter = make_engine(family)._adapter
        torch.manual_seed(0)
        prompts = [torch.randint(3, 1000, (n,)) for n in (70, 5, 33, 50)]
        alone, packed = [], []
        for ids in prompts:
            for bucket in (alone, packed):
                cache = adapter.new_cache(len(ids) + 24)
                adapter.forward(ids, torch.arange(len(ids)), cache)
                bucket.append(cache)

        def segments(caches):
            n0, n1, n2, n3 = (len(p) for p in prompts)
            scattered = torch.tensor([10, 11, 20, 40, n3 - 1])
            return [
                Segment(torch.tensor([7]), torch.tensor([n0]), caches[0], logits=1),
                Segment(torch.tensor([7, 8, 9]), torch.arange(n1, n1 + 3), caches[1], logits=3, decode=True),  # runs first
                Segment(torch.arange(3, 23), torch.arange(n2, n2 + 20), caches[2], logits=1),
                Segment(prompts[3][scattered], scattered, caches[3], logits=1),
            ]

        with attention_in_one_call(one_call):
            together = adapter.forward_packed(segments(packed))
        for b, segment in enumerate(segments(alone)):
            single = adapter._segment_alone(segment)  # the model's own or the sparse attention
            torch.testing.assert_close(together[b].logits, single.logits, rtol=1e-4, atol=1e-4)
            assert packed[b].get_seq_length() == alone[b].get_seq_length()
            keys_a, values_a = adapter.cache_tensors(alone[b])
            keys_p, values_p = adapter.cache_tensors(packed[b])
            torch.testing.assert_close(keys_p, keys_a, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(values_p, values_a, rtol=1e-4, atol=1e-4)


def test_models_whose_attention_is_their_own_decode_one_row_per_pass(make_engine, docs, monkeypatch):
    from kvboost_rag.hf import probes

    prompts = _prompts(docs)
    alone = [_warmed(make_engine, "llama", docs).generate(p, max_new_tokens=6) for p in prompts]
    monkeypatch.setattr(probes, "attention_calls", lambda: 0)  # as if no layer called it
    engine = _warmed(make_engine, "llama", docs)
    assert not engine._adapter.features.batched_decoding
    for a, b in zip(alone, engine.generate_batch(prompts, max_new_tokens=6)):
        _same(a, b)


def test_a_batch_larger_than_the_places_of_prompts_that_end_at_their_first_token_returns(make_engine):
    """Prompts that end at their first token give their places back only when followed: a
    later prompt waiting for a place has the earlier ones followed to their first token
    first, so a batch of more prompts than places finishes (it used to wait for ever)."""
    import threading

    engine = make_engine("llama", max_batch_size=4)
    prompts = [f"Question {i}: what does the reference say about item {i}?" for i in range(11)]
    outputs: list = []
    thread = threading.Thread(target=lambda: outputs.extend(engine.generate_batch(prompts, max_new_tokens=1)), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate_batch of more prompts than places did not return"
    alone = [engine.generate(prompt, max_new_tokens=1).token_ids for prompt in prompts]
    assert [result.token_ids for result in outputs] == alone
    assert engine._places.admitted == 0 and engine._places.held_bytes == 0
