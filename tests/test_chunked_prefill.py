"""A prompt computed across several steps of the engine loop gives what one pass gives, on every
path (full prefill, the tokens after a prefix hit, the repair's probe and blend pass, warming),
over slice sizes and model families, in float32 and bfloat16; and a stream decoding in the same
passes as another prompt's slices leaves every answer as it is alone."""

from __future__ import annotations

import threading

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from test_batch_warm import _documents, _stored, count_segments
from devices import engine_device_settings
from test_low_precision import assert_close_16bit, engine_in

from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import ROPE_FAMILIES, tiny_model
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.passes import TokenPass
from kvboost_rag.repair.probe import run_probe
from kvboost_rag.dev.threads import HUNG_SECONDS, wait_for

#: Chunked and whole passes round differently (other matrix shapes), nothing else.
ATOL = 1e-4
#: Chunk sizes tried: the smallest allowed, and one that leaves a short last chunk.
CHUNKS = (16, 37)


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a.float(), b.float(), atol=ATOL, rtol=0), f"max diff {(a.float() - b.float()).abs().max():.2e}"


def _pair(tokenizer, family: str, chunk: int, device: str = "cpu", **settings) -> tuple[KVBoost, KVBoost]:
    """Engines over one model on ``device``: whole passes (the prompts here are shorter than
    the default chunk), and slices of ``chunk`` tokens a step."""
    model = tiny_model(family)
    placed = engine_device_settings(device)
    make = lambda **extra: KVBoost.from_model(  # noqa: E731
        model, tokenizer, chunk_size=32, show_progress=False, **placed, **settings, **extra
    )
    return make(), make(prefill_chunk_tokens=chunk)


def test_slices_cover_the_tokens_in_order_and_keep_a_long_enough_last_slice(tokenizer):
    adapter = ModelAdapter(tiny_model("llama"), tokenizer)

    def stops(count: int, budget: int, record: int = 0) -> list[int]:
        request = TokenPass(torch.zeros(count, dtype=torch.long), torch.arange(count), adapter.new_cache(count), record=record)
        done, out = 0, []
        while done < count:
            done = request.next_stop(done, budget)
            out.append(done)
        return out

    assert stops(100, 32) == [32, 64, 96, 100]
    assert stops(100, 32, record=10) == [32, 64, 90, 100]
    assert stops(100, 32, record=50) == [32, 50, 100]
    assert stops(20, 32, record=50) == [20]
    assert stops(5, 0) == [1, 2, 3, 4, 5]  # a budget of nothing still moves on


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("family", [*ROPE_FAMILIES, "gpt2"])
def test_chunked_full_prefill_and_prefix_hit_equal_whole_passes(tokenizer, docs, family, chunk, device):
    whole, chunked = _pair(tokenizer, family, chunk, device)
    prompt = rag_prompt(docs[:3], "What is described first?")
    prefix = prompt[: prompt.index(docs[1])]  # a prefix hit with two documents and a question after it
    a = whole.generate(prompt, max_new_tokens=4, reuse=False, return_logits=True)
    b = chunked.generate(prompt, max_new_tokens=4, reuse=False, return_logits=True)
    assert a.prompt_tokens > 4 * chunk
    assert_close(a.first_token_logits, b.first_token_logits)
    assert_close(a.step_logits, b.step_logits)
    for engine in (whole, chunked):
        engine.warm(prefix)
    hit_a = whole.generate(prompt, max_new_tokens=1, return_logits=True)
    hit_b = chunked.generate(prompt, max_new_tokens=1, return_logits=True)
    assert hit_b.strategy == "exact" and hit_b.prefix_hit_tokens > 0 and hit_b.live_tokens > chunk
    assert_close(hit_a.first_token_logits, hit_b.first_token_logits)
    assert_close(a.first_token_logits, hit_b.first_token_logits)


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3"])
def test_chunked_repair_passes_equal_whole_passes(tokenizer, docs, family, strategy, device):
    # keep_document_start covers every cached token: the probe or selection pass still runs,
    # and the blend pass must then equal full prefill; a partial ratio must repeat the whole
    # engine's choice.
    for settings in ({"recompute_ratio": 0.3, "keep_document_start": 10_000}, {"recompute_ratio": 0.3}):
        whole, chunked = _pair(tokenizer, family, 16, device, recompute_strategy=strategy, probe_queries=4, **settings)
        prompt = rag_prompt([docs[2], docs[0], docs[3], docs[1]])
        results = []
        for engine in (whole, chunked):
            engine.warm(SYSTEM_PROMPT)
            engine.warm_documents(docs[:4])
            results.append(engine.generate(prompt, max_new_tokens=1, return_logits=True))
        a, b = results
        assert b.strategy == strategy and b.content_hit_tokens > 0 and b.recomputed_tokens == a.recomputed_tokens
        assert_close(a.first_token_logits, b.first_token_logits)
    full = whole.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
    assert (full.first_token_logits - a.first_token_logits).abs().max() > 10 * ATOL  # the partial ratio repaired


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_probe_in_chunks_records_what_the_whole_probe_records(tokenizer, family):
    adapter = ModelAdapter(tiny_model(family), tokenizer)
    n = 120
    ids = torch.randint(3, 200, (n,))
    keys, values = adapter.buffers(n + 1)
    adapter.forward(ids, torch.arange(n), adapter.cache_over(keys, values, 0))  # a stitched prompt, exact here
    live = torch.tensor(sorted({*range(40, 60), *range(90, n)}))
    records = []
    for slice_tokens in (None, 16):
        k, v = keys.clone(), values.clone()
        records.append(run_probe(adapter, ids[live], live, k, v, n, queries=4, slice_tokens=slice_tokens))
    assert len(records[0]) == len(records[1]) == adapter.num_layers
    for whole, chunked in zip(*records):
        assert_close(whole, chunked)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_warming_in_slices_stores_what_whole_passes_store(tokenizer, family):
    whole, chunked = _pair(tokenizer, family, 16)
    texts = _documents()
    assert [r.new_tokens for r in chunked.warm_documents(texts)] == [r.new_tokens for r in whole.warm_documents(texts)]
    for text in texts:
        for (k1, v1), (k2, v2) in zip(_stored(whole, text), _stored(chunked, text), strict=True):
            torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_in_bfloat16_matches_the_whole_pass(tokenizer, docs, family):
    prompt = rag_prompt(docs[:3])
    whole = engine_in(tokenizer, family, torch.bfloat16)
    chunked = engine_in(tokenizer, family, torch.bfloat16, prefill_chunk_tokens=16)
    a = whole.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
    b = chunked.generate(prompt, max_new_tokens=1, reuse=False, return_logits=True)
    assert a.prompt_tokens > 4 * 16
    assert_close_16bit(a.first_token_logits, b.first_token_logits, torch.bfloat16)


def _mixed_passes(engine: KVBoost) -> list[int]:
    """Make the loop's first pass with a decode row wait until a second request holds a place
    (so that request's prompt work meets the stream's decode rows, whatever the threads'
    timing); returns the number of passes that carried decode rows and prompt slices both."""
    adapter, mixed, met = engine._adapter, [], []
    real = adapter.forward_segments

    def forward(segments):
        rows = [s for s in segments if s.logits == len(s)]
        if rows and not met:  # the stream's first step waits for the other request
            wait_for(lambda: engine._places.admitted >= 2)
            met.append(1)
        if rows and len(rows) < len(segments):
            mixed.append(1)
        return real(segments)

    adapter.forward_segments = forward
    return mixed


@pytest.mark.parametrize(("family", "chunk"), [("llama", 16), ("gemma2", 16), ("qwen3", 37)])
def test_a_stream_decoding_in_the_passes_of_another_prompt_changes_no_answer(make_engine, docs, family, chunk):
    """A stream decodes while another prompt (documents hit, repaired) prefills in slices of
    at most ``chunk`` tokens: its probe and blend slices ride in the stream's decode passes."""

    def fresh() -> KVBoost:
        engine = make_engine(family, prefill_chunk_tokens=chunk, max_decode_wait=0.0)
        engine.warm(SYSTEM_PROMPT)
        engine.warm_documents(docs[:4])
        return engine

    streaming, prefilling = rag_prompt([docs[1], docs[0]], "Go on."), rag_prompt(docs[:5], "What is described?")
    alone = [fresh().generate(p, max_new_tokens=n) for p, n in ((streaming, 40), (prefilling, 8))]
    engine = fresh()
    mixed = _mixed_passes(engine)
    stream = engine.stream(streaming, max_new_tokens=40)
    pieces: list[str] = []
    reader = threading.Thread(target=lambda: pieces.extend(stream))
    reader.start()
    wait_for(lambda: engine._places.admitted == 1)  # the stream holds its place; its first step waits
    other = engine.generate(prefilling, max_new_tokens=8)
    reader.join(HUNG_SECONDS)
    assert mixed, "no pass carried the stream's row and the other prompt's slice together"
    assert stream.result.token_ids == alone[0].token_ids and "".join(pieces) == alone[0].output_text
    assert other.token_ids == alone[1].token_ids
