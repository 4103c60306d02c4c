"""Host reads of tensor values on the hot path: each is a device sync on a GPU.

A ``TorchDispatchMode`` counts ``aten::_local_scalar_dense`` (what ``int(t)``, ``float(t)``,
``bool(t)`` and ``t.item()`` dispatch) during one ``generate``; the count must not grow with
the number of documents in the prompt.
"""

from __future__ import annotations

import pytest
import torch
from rag_prompts import SYSTEM_PROMPT, rag_prompt
from torch.utils._python_dispatch import TorchDispatchMode

from kvboost_rag.corpus import python_reference_documents


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads(engine, prompt: str) -> tuple[int, int]:
    with HostReads() as reads:
        result = engine.generate(prompt, max_new_tokens=2)
    return reads.count, result.content_hit_tokens


def test_counter_sees_host_reads():
    with HostReads() as reads:
        int(torch.tensor([3, 4]).sum())
        torch.tensor(2.5).item()
    assert reads.count == 2


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_host_reads_do_not_grow_with_documents(make_engine, strategy):
    docs = python_reference_documents(max_chars=320)[:12]
    engine = make_engine("llama", recompute_strategy=strategy)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs)
    few = rag_prompt(docs[2::-1])
    many = rag_prompt(docs[::-1])
    _reads(engine, few)  # first calls (attention backends, lazy set-up) out of the way
    _reads(engine, many)
    reads_few, hits_few = _reads(engine, few)
    reads_many, hits_many = _reads(engine, many)
    assert hits_many > 2 * hits_few > 0, "the larger prompt serves more documents from cache"
    assert reads_many <= reads_few, f"{reads_few} host reads with 3 documents, {reads_many} with {len(docs)}"
