"""Prefill buffers lent and reused on the CPU: a pair goes back only once decoding and the
write-back are both done with it, comes back for a later prompt of the same rounded length, carries
nothing from one request into the next (tokens and logits as with fresh buffers, alone,
batched and while another stream still decodes), and idle memory stays within its budget,
lent and idle memory within the pool's."""

from __future__ import annotations

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from test_draft_decoding import assert_same_greedy

from kvboost_rag.generation.host_buffers import GRANULE, HostBufferPool


def _allocate(capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.empty((2, 2, capacity, 4))
    return keys, torch.empty_like(keys)


def _storage(lease) -> int:
    return lease.buffers(1)[0].untyped_storage().data_ptr()


def test_a_pair_goes_back_when_both_holders_released_it_and_is_lent_again():
    pool = HostBufferPool(_allocate, max_idle_bytes=2**30)
    lease = pool.lease(1500)
    assert lease.capacity == 2 * GRANULE and lease.buffers(1500)[0].shape == (2, 2, 2 * GRANULE, 4)
    with pytest.raises(ValueError, match="do not fit"):
        lease.buffers(2 * GRANULE + 1)
    lease.release("decode")
    lease.release("decode")  # again: nothing
    assert pool.idle_buffers == 0 and not lease.released
    lease.release("request")
    assert pool.idle_buffers == 1 and lease.released
    again = pool.lease(1800)  # fits the idle pair
    assert _storage(again) == _storage(lease) and pool.idle_buffers == 0
    other = pool.lease(1800)  # the idle pair is lent: a new one
    assert _storage(other) != _storage(again)


def test_a_prompt_takes_only_a_pair_of_its_rounded_capacity():
    """So it holds exactly the bytes the batch's places admitted it for."""
    pool = HostBufferPool(_allocate, max_idle_bytes=2**30)
    large = pool.lease(5000)
    for holder in ("decode", "request"):
        large.release(holder)
    small = pool.lease(900)
    assert small.capacity == GRANULE and _storage(small) != _storage(large) and pool.idle_buffers == 1
    assert pool.lease(3000).capacity == 3 * GRANULE  # not the idle pair of 5
    assert pool.lease(4500).capacity == 5 * GRANULE and pool.idle_buffers == 0  # the idle pair
    assert HostBufferPool.capacity_for(1) == GRANULE and HostBufferPool.capacity_for(GRANULE + 1) == 2 * GRANULE


def test_lent_and_idle_pairs_together_stay_within_the_pools_bytes():
    pair_bytes = 2 * 2 * 2 * GRANULE * 4 * 4  # K and V of 1 granule, float32
    pool = HostBufferPool(_allocate, max_idle_bytes=4 * pair_bytes, max_bytes=3 * pair_bytes)
    first = [pool.lease(GRANULE) for _ in range(2)]
    for lease in first:
        for holder in ("decode", "request"):
            lease.release(holder)
    assert pool.idle_bytes == 2 * pair_bytes and pool.lent_bytes == 0
    held = [pool.lease(2 * GRANULE), pool.lease(3 * GRANULE)]  # 5 pairs' bytes lent: no idle one kept
    assert pool.lent_bytes == 5 * pair_bytes and pool.idle_bytes == 0
    for lease in held:
        for holder in ("decode", "request"):
            lease.release(holder)
    assert pool.lent_bytes == 0 and pool.idle_bytes <= 3 * pair_bytes


def test_idle_pairs_beyond_the_budget_go_oldest_first():
    pair_bytes = 2 * 2 * 2 * GRANULE * 4 * 4  # K and V of 1 granule, float32
    pool = HostBufferPool(_allocate, max_idle_bytes=2 * pair_bytes)
    leases = [pool.lease(GRANULE) for _ in range(3)]
    for lease in leases:
        for holder in ("decode", "request"):
            lease.release(holder)
    assert pool.idle_buffers == 2 and pool.idle_bytes == 2 * pair_bytes
    kept = {_storage(pool.lease(GRANULE)), _storage(pool.lease(GRANULE))}
    assert kept == {_storage(leases[1]), _storage(leases[2])}


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
    allocated = []
    allocate = pool._allocate
    pool._allocate = lambda capacity: allocated.append(capacity) or allocate(capacity)
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

    for prompt in (first, second, first):  # the pair each prompt wrote is lent to the next
        same(run(pooled, prompt), run(fresh, prompt))
    assert len(allocated) == 1 and pool.idle_buffers == 1
    # A stream still decoding holds its pair: the request beside it gets a new one.
    streams = [engine.stream(first, max_new_tokens=12, return_logits=True) for engine in (pooled, fresh)]
    for stream in streams:
        next(stream)
    same(run(pooled, second), run(fresh, second))
    assert len(allocated) == 2
    for stream in streams:
        for _ in stream:
            pass
    same(streams[0].result, streams[1].result)
    assert pool.idle_buffers == 2
    for a, b in zip(*(engine.generate_batch([second, first], max_new_tokens=12, return_logits=True) for engine in (pooled, fresh))):
        same(a, b)
    assert len(allocated) == 2 and pool.idle_buffers == 2
