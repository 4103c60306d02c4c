"""Captured rows steps (kvboost_rag.hf.captured): compiled graphs over a static K/V pool.

The steps are compiled as on a GPU: ``fullgraph`` (a graph break fails the build), traced with
``aot_eager`` on the CPU (the same graphs and guards, without generating kernels; FlexAttention
then runs its reference math) and with inductor and CUDA graphs on CUDA. Each test checks one
promise: logits and greedy tokens equal the eager path's (the model over a BufferedCache) for
several families, alone and batched, rows of different lengths and token counts; padded
tokens never change a real row; no host read inside a step and no buffer moves; a bounded
number of graphs for every prompt length and batch size; the block masks list exactly the
blocks the queries read (what the GPU kernel skips by, which the reference math ignores).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from devices import DEVICES, device_params
from torch._dynamo.utils import counters
from torch.nn.attention import flex_attention as flex_module

from kvboost_rag.cache.codec import KVLayout
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.dev.op_counts import OpCounter, profile_counts
from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.captured import (
    CapturedRows,
    Row,
    Slot,
    SlotPool,
    build_captured_rows,
    captured_steps_wanted,
    plan_capacities,
)
from kvboost_rag.hf.captured.attention import block_mask, missing_support
from kvboost_rag.hf.captured.rows import pack_rows

ATOL = 1e-4
#: Slots of the pools the tests share: prompts of a few hundred tokens and decoded tokens.
CAPACITIES = [1024, 512, 256, 256]
BUCKETS = (1, 8)


def _backend(device: str) -> str:
    return "inductor" if device == "cuda" else "aot_eager"


#: Families of this module's models.
FAMILIES = ("llama", "gemma2", "stablelm")


@functools.cache
def _steps(family: str, device: str) -> CapturedRows:
    """Prepared steps over a tiny model of ``family`` (built once per test process). Every
    family's model class exists before the first compile: transformers keeps a registry of
    model classes that compiled code guards on, and a class first seen later would make every
    earlier graph compile again."""
    for known in FAMILIES:
        tiny_model(known)
    adapter = ModelAdapter(tiny_model(family).to(device), tiny_tokenizer())
    pool = SlotPool(adapter.layout, CAPACITIES, adapter.dtype, adapter.device, max(BUCKETS))
    steps = CapturedRows(adapter, pool, BUCKETS, backend=_backend(device))
    assert steps.prepare(), steps.reason
    return steps


class _Sequences:
    """Slots holding prompts prefilled by the eager path, and copies of their K/V for eager
    references; the slots go back to the pool on exit."""

    def __init__(self, steps: CapturedRows, lengths: list[int], seed: int = 0) -> None:
        self.steps, self.adapter, self.pool = steps, steps.adapter, steps.pool
        generator = torch.Generator().manual_seed(seed)
        self.slots, self.lengths, self.first_logits = [], list(lengths), []
        for length in lengths:
            slot = self.pool.acquire(length + 16)
            assert slot is not None
            self.slots.append(slot)
            keys, values = self.pool.buffers(slot)
            ids = torch.randint(3, 1000, (length,), generator=generator)
            cache = self.adapter.cache_over(keys, values, 0)
            self.first_logits.append(self.adapter.forward(ids, torch.arange(length), cache))

    def __enter__(self) -> _Sequences:
        return self

    def __exit__(self, *exc) -> None:
        for slot in self.slots:
            self.pool.release(slot)

    def eager_cache(self, index: int):
        """A cache over a copy of sequence ``index``'s K/V (room for 16 more tokens)."""
        keys, values = self.pool.buffers(self.slots[index])
        length = self.lengths[index]
        own_keys, own_values = self.adapter.buffers(length + 16)
        own_keys[:, :, :length] = keys[:, :, :length]
        own_values[:, :, :length] = values[:, :, :length]
        return self.adapter.cache_over(own_keys, own_values, length)


@torch.inference_mode()
def _eager_logits(adapter: ModelAdapter, cache, position: int, tokens: list[int]) -> torch.Tensor:
    """``[tokens, vocab]`` logits of ``tokens`` at ``position..`` over ``cache`` (the model's
    own attention), appending their K/V."""
    out = adapter.model(
        input_ids=torch.tensor([tokens], device=adapter.device),
        position_ids=torch.arange(position, position + len(tokens), device=adapter.device).view(1, -1),
        cache=cache, use_cache=True, logits_to_keep=0,
    )
    return out.logits[0].float()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a.cpu(), b.cpu(), atol=ATOL, rtol=0), f"max diff {(a.cpu() - b.cpu()).abs().max():.2e}"


@pytest.mark.parametrize(("device", "family"), device_params(cpu=FAMILIES, cuda=["llama", "gemma2"]))
def test_rows_of_different_lengths_and_token_counts_equal_the_eager_path(device, family):
    """One step of three rows (3, 1 and 2 new tokens at positions 300, 90 and 5: a
    draft-verify row and decode rows; Gemma 2's window of 48 and its softcap apply): each
    token's logits and the K/V written equal the eager path's."""
    steps = _steps(family, device)
    with _Sequences(steps, [300, 90, 5]) as seqs:
        new = [[int(seqs.first_logits[0].argmax()), 17, 29], [int(seqs.first_logits[1].argmax())], [41, 43]]
        caches = [seqs.eager_cache(i) for i in range(3)]
        expected = [_eager_logits(steps.adapter, caches[i], seqs.lengths[i], new[i]) for i in range(3)]
        rows = [Row(slot, tokens, length) for slot, tokens, length in zip(seqs.slots, new, seqs.lengths)]
        logits = steps.run(rows)
        assert logits.flat.shape == (8, steps.adapter.vocab_width)
        for i, row in enumerate(rows):
            _close(logits.row(i), expected[i])
            keys, values = seqs.pool.buffers(row.slot)
            written = slice(row.position, row.position + len(row.tokens))
            _close(keys[:, :, written], torch.stack([layer.keys[0, :, written] for layer in caches[i].layers]))
            _close(values[:, :, written], torch.stack([layer.values[0, :, written] for layer in caches[i].layers]))


def _greedy_captured(
    steps: CapturedRows, slots, lengths: list[int], tokens: list[int], count: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``count`` greedy steps of the sequences in ``slots`` together: their tokens, and each
    step's ``[rows, vocab]`` last logits."""
    produced, logits_seen = [[] for _ in slots], []
    lengths, tokens = list(lengths), list(tokens)
    for _ in range(count):
        logits = steps.run([Row(slot, [token], length) for slot, token, length in zip(slots, tokens, lengths)])
        logits_seen.append(torch.stack([logits.last(i).cpu() for i in range(len(slots))]))
        tokens = [int(logits.last(i).argmax()) for i in range(len(slots))]
        for i, token in enumerate(tokens):
            produced[i].append(token)
            lengths[i] += 1
    return produced, logits_seen


def _greedy_eager(
    adapter: ModelAdapter, cache, length: int, token: int, count: int
) -> tuple[list[int], list[torch.Tensor]]:
    """``count`` greedy steps of one sequence on the eager path: its tokens and logits."""
    produced, logits_seen = [], []
    for _ in range(count):
        logits = _eager_logits(adapter, cache, length, [token])[0]
        logits_seen.append(logits.cpu())
        token, length = int(logits.argmax()), length + 1
        produced.append(token)
    return produced, logits_seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_decoding_alone_and_batched_gives_the_eager_tokens(family, device):
    """Six greedy steps of one sequence alone (bucket 1) and of three together (bucket 8,
    padded): the same tokens as decoding each on the eager path, logits within tolerance."""
    steps = _steps(family, device)
    with _Sequences(steps, [200, 61, 3], seed=1) as seqs:
        firsts = [int(logits.argmax()) for logits in seqs.first_logits]
        expected = [_greedy_eager(steps.adapter, seqs.eager_cache(i), seqs.lengths[i], firsts[i], 6) for i in range(3)]
        alone, alone_logits = _greedy_captured(steps, seqs.slots[:1], seqs.lengths[:1], firsts[:1], 6)
        assert alone[0] == expected[0][0]
        for step, logits in enumerate(alone_logits):
            _close(logits[0], expected[0][1][step])
        together, together_logits = _greedy_captured(steps, seqs.slots, seqs.lengths, firsts, 6)
        assert together == [tokens for tokens, _ in expected]
        for step, logits in enumerate(together_logits):
            for i in range(3):
                _close(logits[i], expected[i][1][step])


@pytest.mark.parametrize(("device", "family"), device_params(cpu=["llama", "gemma2"], cuda=["llama"]))
def test_a_blend_pass_at_scattered_positions_equals_the_eager_pass_over_an_armed_cache(tokenizer, device, family):
    """A prompt stitched into a slot, 20 chosen tokens and the last ones run at their
    positions (one row, last logits only): the last logits and the K/V they leave equal the
    eager blend pass over an armed cache; every other row keeps its K/V."""
    adapter = ModelAdapter(tiny_model(family).to(device), tokenizer)
    pool = SlotPool(adapter.layout, [512], adapter.dtype, adapter.device, 32)
    steps = CapturedRows(adapter, pool, (32,), backend=_backend(device), last_logits=True)
    assert steps.prepare(), steps.reason
    slot = pool.acquire(300)
    keys, values = pool.buffers(slot)
    ids = torch.randint(3, 1000, (300,), generator=torch.Generator().manual_seed(5))
    adapter.forward(ids, torch.arange(300), adapter.cache_over(keys, values, 0))
    keys[:, :, 100:200] *= 1.5  # stale K/V of "reused" tokens, as a stitched prompt has
    chosen = torch.tensor(sorted({*range(3, 290, 15), 297, 298, 299}))
    own_keys, own_values = adapter.buffers(300)
    own_keys.copy_(keys[:, :, :300])
    own_values.copy_(values[:, :, :300])
    armed = adapter.cache_over(own_keys, own_values, 300)
    armed.arm(chosen.to(device))
    expected = adapter.forward(ids[chosen], chosen, armed, sparse_queries=True)
    before = keys[:, :, :300].clone()
    logits = steps.run([Row(slot, ids[chosen].tolist(), positions=chosen.tolist())])
    assert logits.flat.shape == (1, adapter.vocab_width)
    _close(logits.last(0), expected)
    _close(keys[:, :, :300], own_keys)
    _close(values[:, :, :300], own_values)
    others = torch.ones(300, dtype=torch.bool)
    others[chosen] = False
    assert torch.equal(keys[:, :, :300][:, :, others.to(device)], before[:, :, others.to(device)])
    with pytest.raises(InvalidInputError, match="ascending"):
        steps.run([Row(slot, [1, 2], positions=[5, 4])])


@pytest.mark.parametrize("device", DEVICES)
def test_padded_tokens_never_change_a_real_row(device):
    """A step of 3 real tokens padded to 8 (one row ending exactly at its slot's last row):
    only the 3 rows the real tokens own and the scratch rows change."""
    steps = _steps("llama", device)
    pool = steps.pool
    with _Sequences(steps, [100, 10]) as seqs:
        full, other = seqs.slots
        before_keys, before_values = pool.keys.clone(), pool.values.clone()
        rows = [Row(full, [5, 6], full.capacity - 2), Row(other, [7], 10)]
        steps.run(rows)
        owned = torch.zeros(pool.total_tokens, dtype=torch.bool)
        owned[[full.start + full.capacity - 2, full.start + full.capacity - 1, other.start + 10]] = True
        owned[pool.scratch_start :] = True
        unchanged = (~owned).to(device)
        assert torch.equal(pool.keys[:, :, unchanged], before_keys[:, :, unchanged])
        assert torch.equal(pool.values[:, :, unchanged], before_values[:, :, unchanged])
        real = torch.tensor([full.start + full.capacity - 1, other.start + 10], device=device)
        assert not torch.equal(pool.keys[:, :, real], before_keys[:, :, real])
        with pytest.raises(InvalidInputError, match="within its slot"):
            steps.run([Row(full, [5, 6], full.capacity - 1)])
        with pytest.raises(InvalidInputError, match="share a slot"):
            steps.run([Row(full, [5], 0), Row(full, [6], 1)])
        with pytest.raises(InvalidInputError, match="not one of this pool's"):
            steps.run([Row(Slot(full.index, full.start + 128, full.capacity), [5], 0)])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("device", DEVICES)
def test_no_host_read_inside_a_step_and_no_buffer_moves(device, monkeypatch):
    """The step as compiled (profiler) and as plain code (a dispatch-mode counter): no read of
    a tensor value on the host; the pool's and the input tables' addresses stay, and on CUDA
    the step is one input copy and one graph launch, no synchronization, and the graph's
    output buffer stays."""
    steps = _steps("llama", device)
    pool = steps.pool
    before = [tensor.data_ptr() for tensor in steps.fixed_tensors]
    assert len(before) == 2 + len(steps.buckets)
    with _Sequences(steps, [50, 20]) as seqs:
        rows = [Row(seqs.slots[0], [3, 4, 5], 50), Row(seqs.slots[1], [6], 20)]
        first = steps.run(rows).flat.data_ptr()
        counted = profile_counts(lambda: steps.run(rows))
        assert counted.host_reads == 0 and counted.copies >= 1  # the profiler saw the step (its input copy)
        if device == "cuda":  # one input copy, one graph launch, no wait beyond what profiling itself does
            profiler_only = profile_counts(lambda: None)
            assert counted.syncs == profiler_only.syncs, (counted, profiler_only)
            assert counted.memcpys == 1 and counted.launches == counted.graph_launches == 1, counted
            assert steps.run(rows).flat.data_ptr() == first
        plain = CapturedRows(steps.adapter, pool, (8,), backend=None, cuda_graphs=False)
        assert plain.prepare(), plain.reason
        # FlexAttention's plain-code path, not the compiled wrapper it otherwise uses even
        # uncompiled (torch.compile cannot run under a dispatch mode).
        monkeypatch.setattr(flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
        with OpCounter() as counter:
            plain.run(rows)
        assert counter.counts.host_reads == 0 and counter.counts.kernels > 100, counter.counts.by_name
    assert [tensor.data_ptr() for tensor in steps.fixed_tensors] == before


def test_graphs_are_bounded_over_prompt_lengths_and_batch_sizes(tokenizer):
    """Rows at every prompt length from 1k to 32k tokens, batches of 1 to 8: one graph per
    token bucket, all built by prepare(), none on a step."""
    torch._dynamo.reset()
    counters.clear()  # dynamo's reset keeps its counters; earlier tests in this process compiled too
    adapter = ModelAdapter(tiny_model("llama", num_hidden_layers=2, max_position_embeddings=40000), tokenizer)
    capacities = [32768, 16384, 8192, 4096, 2048, 1024, 1024, 1024]
    pool = SlotPool(adapter.layout, capacities, adapter.dtype, adapter.device, 8)
    steps = CapturedRows(adapter, pool, (1, 2, 4, 8), backend="aot_eager")
    assert steps.prepare(), steps.reason
    built = counters["stats"]["unique_graphs"]
    assert built == 4, built
    slots = [pool.acquire(capacity) for capacity in capacities]
    positions = []
    for batch in range(1, 9):
        rows = [Row(slot, [batch], slot.capacity - 1 - batch) for slot in slots[:batch]]
        positions += [row.position for row in rows]
        steps.run(rows)
    assert min(positions) < 1024 < 32000 < max(positions)
    assert counters["stats"]["unique_graphs"] == built
    assert not counters["graph_break"]


def test_block_masks_list_exactly_the_blocks_each_query_block_reads():
    """The block lists the GPU kernel follows (the CPU reference math reads the mask function
    only): every block holding a row some query sees, no other, in increasing order; with and
    without a sliding window, one query block and several."""
    generator = torch.Generator().manual_seed(0)
    total = 40 * 128
    for queries, window in ((8, None), (8, 300), (256, None), (256, 200)):
        last = torch.randint(0, total, (queries,), generator=generator)
        first = torch.clamp(last - torch.randint(0, 2000, (queries,), generator=generator), min=0)
        mask = block_mask(first, last, total, window)
        lowest = first if window is None else torch.maximum(first, last - window + 1)
        keys = torch.arange(total)
        seen = (keys.view(1, -1) >= lowest.view(-1, 1)) & (keys.view(1, -1) <= last.view(-1, 1))  # [queries, keys]
        q_blocks = max(1, queries // 128)
        wanted = seen.view(q_blocks, -1, total // 128, 128).any(dim=3).any(dim=1)  # [q_blocks, kv_blocks]
        for q in range(q_blocks):
            count = int(mask.kv_num_blocks[0, 0, q])
            listed = mask.kv_indices[0, 0, q, :count].tolist()
            assert listed == wanted[q].nonzero().view(-1).tolist()
        dense = torch.stack([mask.mask_mod(0, 0, torch.tensor(q), keys) for q in range(queries)])
        assert torch.equal(dense, seen)


def test_a_slot_serves_the_eager_paths_as_contiguous_buffers_do(tokenizer):
    """A prompt prefilled into a slot (a strided view of the pool) and the armed scatter pass
    of the blend over it give what contiguous buffers give, bit for bit."""
    adapter = ModelAdapter(tiny_model("llama"), tokenizer)
    pool = SlotPool(adapter.layout, [256, 256], adapter.dtype, adapter.device, 8)
    slot = pool.acquire(200)
    ids = torch.randint(3, 1000, (120,), generator=torch.Generator().manual_seed(3))
    results = []
    for keys, values in (pool.buffers(slot), adapter.buffers(256)):
        cache = adapter.cache_over(keys, values, 0)
        first = adapter.forward(ids, torch.arange(120), cache)
        chosen = torch.tensor([7, 40, 119])
        cache.arm(chosen)
        again = adapter.forward(ids[chosen], chosen, cache, sparse_queries=True)
        results.append((first, again, keys[:, :, :120].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_step_that_cannot_be_captured_leaves_the_eager_path(tokenizer, monkeypatch):
    """Attention outside transformers' interface, or a graph break: prepare() says why and
    run() refuses; nothing is half built."""
    adapter = ModelAdapter(tiny_model("llama"), tokenizer)
    pool = SlotPool(adapter.layout, [256], adapter.dtype, adapter.device, 8)
    unbatched = replace(adapter.features, batched_decoding=False, batched_decoding_reason="no interface")
    monkeypatch.setattr(adapter, "features", unbatched)
    steps = CapturedRows(adapter, pool, (1,), backend="aot_eager")
    assert not steps.prepare() and steps.reason == "no interface" and not steps.available
    with pytest.raises(RuntimeError, match="no interface"):
        steps.run([Row(pool.slots[0], [1], 0)])
    monkeypatch.undo()
    norm = adapter.model.model.norm
    original = type(norm).forward

    def breaking(self, hidden):
        torch._dynamo.graph_break()
        return original(self, hidden)

    monkeypatch.setattr(type(norm), "forward", breaking)
    steps = CapturedRows(adapter, pool, (1,), backend="aot_eager")
    assert not steps.prepare() and "could not be built" in steps.reason
    monkeypatch.undo()
    # A forward replaced on the instance (accelerate's dispatch hooks) would run the original
    # module's code, not the view's: refused with its reason.
    monkeypatch.setattr(norm, "forward", norm.forward)
    steps = CapturedRows(adapter, pool, (1,), backend="aot_eager")
    assert not steps.prepare() and "own forward code" in steps.reason


def test_pool_plan_and_slots():
    """Capacities from the budget, largest first, one of each before a second; slots of the
    smallest capacity that fits; a slot given back twice is refused."""
    assert plan_capacities(64 * 1024, 32768) == [32768, 16384, 8192, 4096, 2048, 1024, 1024]
    assert plan_capacities(3 * 1024, 8192) == [2048, 1024]
    assert plan_capacities(500, 8192) == []
    assert plan_capacities(10**9, 3000)[:3] == [3072, 3072, 3072] and len(plan_capacities(10**9, 3000)) == 8 * 3
    pool = SlotPool(KVLayout(2, 2, 16), [1024, 256, 300], torch.float32, "cpu", 16)
    assert [(s.start, s.capacity) for s in pool.slots] == [(0, 1024), (1024, 256), (1280, 384)]
    assert pool.scratch_start == 1664 and pool.total_tokens == 1664 + 128
    keys, values = pool.buffers(pool.slots[2])
    assert keys.shape == (2, 2, 384, 16) and keys.data_ptr() == pool.keys[:, :, 1280].data_ptr()
    small = pool.acquire(200)
    assert small == pool.slots[1] and pool.acquire(300) == pool.slots[2] and pool.acquire(2000) is None
    pool.release(small)
    with pytest.raises(InvalidInputError, match="not taken"):
        pool.release(small)
    assert SlotPool.planned(KVLayout(2, 2, 16), torch.float32, "cpu", 1000, 4096, 16) is None


def test_the_step_table_the_host_packs():
    """Per token: id, position, pool row, first row read; padded tokens in the scratch rows."""
    pool = SlotPool(KVLayout(1, 1, 8), [256, 128], torch.float32, "cpu", 8)
    a, b = pool.slots
    table = pack_rows([Row(a, [11, 12], 5), Row(b, [13], 0)], 4, pool.scratch_start)
    assert table.tolist() == [
        [11, 12, 13, 0],
        [5, 6, 0, 0],
        [5, 6, 256, 384],
        [0, 0, 256, 384],
    ]
    with pytest.raises(InvalidInputError, match="do not fit"):
        pack_rows([Row(a, [1, 2, 3], 0)], 2, pool.scratch_start)


def test_settings_and_mode(caplog):
    """``auto`` is on for CUDA only; bad buckets are refused naming the fix; a budget holding
    no slot leaves the eager path with a warning."""
    assert missing_support() == ""  # this torch builds them (the suite's CPU torch, 2.13)
    assert captured_steps_wanted("auto", torch.device("cuda")) and not captured_steps_wanted("auto", torch.device("cpu"))
    assert captured_steps_wanted("on", torch.device("cpu")) and not captured_steps_wanted("off", torch.device("cuda"))
    assert KVBoostSettings(captured_token_buckets=(8, 1, 1)).captured_token_buckets == (1, 8)
    with pytest.raises(ValueError, match="powers of two"):
        KVBoostSettings(captured_token_buckets=(3,))
    adapter = ModelAdapter(tiny_model("llama"), tiny_tokenizer())
    assert build_captured_rows(adapter, "auto", 10**9, (1,)) is None  # a CPU: not wanted
    assert build_captured_rows(adapter, "on", 1000, (1,)) is None
    assert "hold no slot" in caplog.text
