"""The data path of one call costs a fixed number of tensor operations.

Stored K/V is cut into chunks (``chunk_size``), but loading them into a prompt must not cost
work per chunk: on a GPU every dispatched operation is a kernel launch and every copy a pass
over memory. These tests count what one ``generate`` dispatches (:mod:`kvboost_rag.dev.op_counts`)
and check the stitch against a plain reference, and that compiled attention is not compiled
again for every prompt length.
"""

from __future__ import annotations

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from torch._dynamo.utils import counters

from kvboost_rag.cache.codec import KVBlock
from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.dev.op_counts import OpCounter, OpCounts
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf import adapter as adapter_module
from kvboost_rag.attention_backends import sparse as attention
from kvboost_rag.prefill.stitch import Run, stitch_documents, stitch_prefix


def _counts(engine, prompt: str) -> tuple[OpCounts, int]:
    engine.generate(prompt, max_new_tokens=1)  # lazy set-up out of the way
    # Its write-back done: the counted call then finds its chunks and its reused host buffers
    # in the same state whatever the write worker's timing.
    engine.flush()
    with OpCounter() as counter:
        result = engine.generate(prompt, max_new_tokens=1)
    return counter.counts, result.content_hit_tokens


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_copies_and_kernels_per_call_do_not_grow_with_the_chunk_count(make_engine, strategy):
    """The same prompt served from chunks of 16 tokens (over 100 chunks) and of 64: the same
    copies and the same kernels, and as many tokens read from cache."""
    docs = python_reference_documents(max_chars=800)[:8]
    prompt = rag_prompt(docs[::-1])
    measured = []
    with attention.use_backend("masked_sdpa"):  # one attention call per layer: no per-query-block loop
        for chunk_size in (16, 64):
            engine = make_engine("llama", chunk_size=chunk_size, recompute_strategy=strategy)
            engine.warm(SYSTEM_PROMPT)
            engine.warm_documents(docs)
            measured.append(_counts(engine, prompt))
    (small, hits_small), (large, hits_large) = measured
    assert hits_small == hits_large > 1000  # about 130 chunks of 16 tokens loaded
    assert small.copies == large.copies, (small.by_name, large.by_name)
    assert small.kernels == large.kernels
    assert small.host_reads == large.host_reads


def test_copies_per_call_do_not_grow_with_the_documents(make_engine):
    """Two documents or eight in the prompt: the same copies (stitching is one concatenation
    per K and V whatever the count)."""
    docs = python_reference_documents(max_chars=500)[:8]
    engine = make_engine("llama", chunk_size=32)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs)
    with attention.use_backend("masked_sdpa"):
        few, hits_few = _counts(engine, rag_prompt([docs[3], docs[1]]))
        many, hits_many = _counts(engine, rag_prompt(docs[::-1]))
    assert hits_many > 3 * hits_few > 0
    assert many.copies == few.copies


def _blocks(layers: int, heads: int, dim: int, sizes: list[int], seed: int = 0) -> list[KVBlock]:
    generator = torch.Generator().manual_seed(seed)
    return [
        KVBlock(
            keys=torch.randn(layers, heads, size, dim, generator=generator),
            values=torch.randn(layers, heads, size, dim, generator=generator),
            token_ids=torch.zeros(size, dtype=torch.long),
            start_position=start,
        )
        for size, start in zip(sizes, [7, 0, 130, 42])
    ]


def _reference_rotation(adapter: ModelAdapter, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """RoPE re-rotation written out on halves (all layers at once, float32, rounded once):
    independent of the adapter's own rotation code."""
    cos, sin = adapter.rotation(delta, 0, keys.shape[0])  # [1 or L, 1, half]
    cos, sin, half = cos.unsqueeze(1), sin.unsqueeze(1), cos.shape[-1]
    x1, x2 = keys[..., :half].float(), keys[..., half : 2 * half].float()
    out = keys.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("one_layer_at_a_time", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_stitch_writes_what_rotating_each_run_alone_writes(tokenizer, family, dtype, one_layer_at_a_time, monkeypatch):
    """Runs of several blocks, some rows skipped, gaps between runs: the keys are bit for bit
    each run rotated on its own by the adapter's reference rotation (float32 math, 16-bit keys
    rounded once), whether the layers are rotated together or one slice at a time (as the
    keys of long prompts are), the values are copied, the rows outside the runs are left as
    they were."""
    if one_layer_at_a_time:
        monkeypatch.setattr(adapter_module, "ROTATION_SLICE_BYTES", 1)
    adapter = ModelAdapter(tiny_model(family).to(dtype), tokenizer)
    layers, heads, dim = adapter.layout.as_tuple()
    blocks = [
        KVBlock(keys=b.keys.to(dtype), values=b.values.to(dtype), token_ids=b.token_ids, start_position=b.start_position)
        for b in _blocks(layers, heads, dim, [20, 9, 33, 5])
    ]
    runs = [Run(1, 0, 3, 9), Run(0, 2, 14, 10), Run(0, 13, 26, 7), Run(2, 0, 40, 33), Run(3, 1, 80, 4)]
    keys, values = adapter.buffers(100)
    keys.fill_(0.5)
    values.fill_(0.25)
    written = stitch_documents(adapter, keys, values, blocks, runs)
    assert written.tolist() == [p for run in runs for p in range(run.position, run.position + run.length)]
    for run in runs:
        block, rows, target = blocks[run.block], slice(run.row, run.row + run.length), slice(run.position, run.position + run.length)
        delta = run.position - (block.start_position + run.row)
        expected = _reference_rotation(adapter, block.keys[:, :, rows], delta)
        assert torch.equal(adapter.rotate_keys(block.keys[:, :, rows], delta), expected)
        assert keys.dtype == dtype and torch.equal(keys[:, :, target], expected)
        assert torch.equal(values[:, :, target], block.values[:, :, rows])
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[written] = False
    untouched[12:14] = untouched[24:26] = untouched[33:40] = untouched[73:80] = False  # gaps: zeros, computed later
    assert bool((keys[:, :, untouched] == 0.5).all()) and bool((values[:, :, untouched] == 0.25).all())


def test_prefix_pieces_are_copied_in_order(tokenizer):
    adapter = ModelAdapter(tiny_model("llama"), tokenizer)
    layers, heads, dim = adapter.layout.as_tuple()
    blocks = _blocks(layers, heads, dim, [16, 16, 10])
    keys, values = adapter.buffers(50)
    assert stitch_prefix(keys, values, [(blocks[0], 16), (blocks[1], 16), (blocks[2], 7)]) == 39
    assert torch.equal(keys[:, :, :39], torch.cat([blocks[0].keys, blocks[1].keys, blocks[2].keys[:, :, :7]], dim=2))
    assert torch.equal(values[:, :, 16:32], blocks[1].values)


def test_overlapping_runs_are_refused(tokenizer):
    adapter = ModelAdapter(tiny_model("llama"), tokenizer)
    layers, heads, dim = adapter.layout.as_tuple()
    blocks = _blocks(layers, heads, dim, [20])
    keys, values = adapter.buffers(40)
    with pytest.raises(ValueError, match="overlap"):
        stitch_documents(adapter, keys, values, blocks, [Run(0, 0, 5, 10), Run(0, 10, 12, 5)])


def test_compiled_attention_compiles_a_bounded_number_of_times_for_every_prompt_length(make_engine):
    """FlexAttention compiled the way it is on a GPU (traced with ``aot_eager`` here): over
    prompts of many lengths, prefix hits and document reuse, a handful of graphs (the variants
    of one query, one block of queries or of keys, several), none after the first prompts, and
    no fall-back to the masked path."""
    torch._dynamo.reset()
    counters.clear()  # dynamo's reset keeps its counters; earlier tests in this process compiled too
    docs = python_reference_documents(max_chars=600)[:12]
    engine = make_engine("llama", chunk_size=32)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs)
    graphs: list[int] = []
    with attention.use_backend("flex"), attention.compile_flex_with("aot_eager"):
        for selection in (docs[:2], docs[2:7], docs[7:12], docs[1:4], docs[::-1], docs[3:5], docs[::2]):
            prompt = rag_prompt(selection)
            reused = engine.generate(prompt, max_new_tokens=2)
            again = engine.generate(prompt, max_new_tokens=2)
            assert reused.content_hit_tokens > 0 and again.content_hit_tokens > 0
            graphs.append(counters["stats"]["unique_graphs"])
    assert not attention.flex_failures()
    assert graphs[-1] <= 6, graphs
    assert graphs[-1] == graphs[-3], f"still compiling for new lengths: {graphs}"
