"""Prefill buffers carved from reused host memory on the CPU: a pair holds its tokens plus less
than a block, goes back only once decoding and the write-back are both done with it, its
memory is lent to a later prompt, it carries nothing from one request into the next (tokens and
logits as with fresh buffers, alone, batched and while another stream still decodes), and the
segments stay within the pool's bytes, the wholly free ones within its idle budget."""

from __future__ import annotations

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from test_draft_decoding import assert_same_greedy

from kvboost_rag.generation.host_buffers import BLOCK, HostBufferPool


def _allocate(capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.empty((2, 2, capacity, 4))
    return keys, torch.empty_like(keys)


def _address(lease) -> int:
    return lease.buffers(1)[0].data_ptr()


def _span(lease) -> tuple[int, int]:
    keys, values = lease.buffers(1)
    return keys.data_ptr(), values.data_ptr() + values.numel() * values.element_size()


def _release(lease) -> None:
    for holder in ("decode", "request"):
        lease.release(holder)


#: Bytes of K and V per token of ``_allocate``'s layout (float32).
PAIR_BYTES_PER_TOKEN = 2 * 2 * 2 * 4 * 4


def test_a_pair_goes_back_when_both_holders_released_it_and_its_memory_is_lent_again():
    pool = HostBufferPool(_allocate, max_idle_bytes=2**24)
    lease = pool.lease(1500)
    assert lease.capacity == pool.capacity_for(1500) and lease.buffers(1500)[0].shape == (2, 2, lease.capacity, 4)
    with pytest.raises(ValueError):
        lease.buffers(lease.capacity + 1)
    lease.release("decode")
    assert pool.lent_bytes == PAIR_BYTES_PER_TOKEN * lease.capacity and not lease.released
    address = _address(lease)
    lease.release("request")
    assert pool.lent_bytes == 0 and lease.released
    again = pool.lease(1500)
    assert _address(again) == address and pool.segments == 1


def test_a_prompt_holds_its_tokens_plus_less_than_a_block_and_pairs_lent_together_do_not_overlap():
    pool = HostBufferPool(_allocate, max_idle_bytes=2**24)
    for tokens in (1, BLOCK, BLOCK + 1, 1500, 4500):
        assert tokens <= pool.capacity_for(tokens) < tokens + BLOCK and pool.capacity_for(tokens) % BLOCK == 0
    leases = [pool.lease(tokens) for tokens in (100, 1500, 70, 4500)]
    assert pool.lent_bytes == sum(PAIR_BYTES_PER_TOKEN * lease.capacity for lease in leases)
    assert pool.lent_bytes == sum(pool.pair_bytes(tokens) for tokens in (100, 1500, 70, 4500))
    spans = sorted(_span(lease) for lease in leases)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for lease in leases:
        keys, values = lease.buffers(1)
        keys.fill_(float(lease.capacity))
        values.fill_(-float(lease.capacity))
    assert all(bool((lease.buffers(1)[0] == lease.capacity).all()) for lease in leases)
    left = _span(leases[1])
    _release(leases[1])
    smaller = pool.lease(1000)  # carved from the range the 1500-token pair left
    assert left[0] <= _address(smaller) < left[1]


def test_segments_stay_within_the_pools_bytes_and_wholly_free_ones_are_kept_within_the_idle_budget():
    segment = 64 * 1024**2
    pool = HostBufferPool(_allocate, max_idle_bytes=2 * segment, max_bytes=3 * segment)
    tokens = segment // PAIR_BYTES_PER_TOKEN // 2  # two pairs to a segment
    leases = [pool.lease(tokens) for _ in range(6)]
    assert pool.segments == 3 and pool.idle_bytes < segment
    for lease in leases:
        _release(lease)
    assert pool.lent_bytes == 0 and pool.segments == 2  # the third wholly free one went back
    big = pool.lease(3 * tokens)  # new segments would pass max_bytes: the free ones go first
    assert pool.segment_bytes <= pool.max_bytes and pool.lent_bytes == PAIR_BYTES_PER_TOKEN * big.capacity


@pytest.mark.parametrize("fill", [True, False])
def test_a_lent_pair_is_filled_as_torch_fills_new_memory(fill, monkeypatch):
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", fill)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    pool = HostBufferPool(_allocate, max_idle_bytes=2**30)
    lease = pool.lease(10)
    for tensor in lease.buffers(10):
        tensor.fill_(3.0)
    for holder in ("decode", "request"):
        lease.release(holder)
    keys, values = pool.lease(10).buffers(10)
    assert bool(torch.isnan(keys).all() and torch.isnan(values).all()) == fill
    assert bool((keys == 3.0).all()) == (not fill)


def test_cpu_requests_on_lent_buffers_decode_as_on_fresh_ones(make_engine, docs):
    pooled = make_engine("llama")
    fresh = make_engine("llama")
    fresh._requests.memory.host_buffers = None  # every request allocates its own buffers
    pool = pooled._requests.memory.host_buffers
    assert pool is not None
    lent: list[tuple[int, int]] = []
    lease = pool.lease
    pool.lease = lambda capacity: (lambda taken: lent.append(_span(taken)) or taken)(lease(capacity))
    for engine in (pooled, fresh):
        engine.warm(SYSTEM_PROMPT)
        engine.warm_documents(docs[:4])
    first, second = rag_prompt([docs[0], docs[1]]), rag_prompt([docs[3], docs[2]], "Summarize.")

    def run(engine, prompt):
        return engine.generate(prompt, max_new_tokens=12, return_logits=True)

    def same(result, reference):
        """Greedy tokens up to a near tie; logits apart by float rounding only (the buffers'
        capacities, so their strides, differ)."""
        assert torch.isfinite(result.step_logits).all()
        assert_same_greedy(result.token_ids, reference.token_ids, reference.step_logits)
        if result.token_ids == reference.token_ids:
            torch.testing.assert_close(result.step_logits, reference.step_logits, rtol=0, atol=1e-4)

    lent.clear()
    for prompt in (first, second, first):  # the memory each prompt wrote is lent to the next
        same(run(pooled, prompt), run(fresh, prompt))
        assert pooled.flush(timeout=60)
    assert len({start for start, _ in lent}) == 1 and pool.segments == 1
    # A stream still decoding holds its pair: the request beside it is lent other memory.
    streams = [engine.stream(first, max_new_tokens=12, return_logits=True) for engine in (pooled, fresh)]
    for stream in streams:
        next(stream)
    same(run(pooled, second), run(fresh, second))
    (held_start, held_end), (beside_start, beside_end) = lent[-2:]
    assert beside_start >= held_end or beside_end <= held_start
    for stream in streams:
        for _ in stream:
            pass
    same(streams[0].result, streams[1].result)
    for a, b in zip(*(engine.generate_batch([second, first], max_new_tokens=12, return_logits=True) for engine in (pooled, fresh))):
        same(a, b)
    assert pool.segments == 1
