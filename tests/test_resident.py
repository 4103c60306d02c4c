"""Giving back the input embeddings' pages after the fingerprint read them: values unchanged,
whether the memory is mapped from a file or anonymous, and nothing asked of memory it may not
concern."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvboost_rag import c_heap
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.decode_weights import resident
from kvboost_rag.decode_weights.resident import MIN_BYTES, page_out, page_out_input_embeddings

linux = pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_PAGEOUT) is Linux's")


def _rss_file_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    return 0


@linux
def test_a_file_mapped_table_keeps_its_values_and_leaves_memory(tmp_path):
    rows = torch.arange(8192 * 1024, dtype=torch.float32).view(8192, 1024)  # 32 MiB
    save_file({"table": rows}, tmp_path / "table.safetensors")
    mapped = load_file(tmp_path / "table.safetensors")["table"]
    assert float(mapped.sum(dtype=torch.float64)) == float(rows.sum(dtype=torch.float64))  # every page read
    before = _rss_file_kib()
    advised = page_out(mapped)
    if advised == 0:
        pytest.skip("this kernel refuses MADV_PAGEOUT (Linux < 5.4)")
    assert advised >= mapped.numel() * 4 - 2 * 4096
    assert _rss_file_kib() < before - 16 * 1024  # most of the 32 MiB left this process
    assert torch.equal(mapped, rows)  # read back from the file: the same values


@linux
def test_anonymous_memory_keeps_its_values():
    table = torch.randn(MIN_BYTES // 4 + 1000)
    copy = table.clone()
    page_out(table)
    assert torch.equal(table, copy)


def test_small_strided_and_other_tensors_are_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(resident.ctypes, "CDLL", lambda *a, **k: calls.append(a) or pytest.fail("madvise called"))
    assert page_out(torch.zeros(1000)) == 0
    assert page_out(torch.zeros(MIN_BYTES // 2, 4)[:, 0]) == 0  # not contiguous
    assert page_out(torch.zeros(MIN_BYTES // 4, device="meta")) == 0
    assert calls == []


def test_a_table_the_output_layer_shares_is_left_alone(monkeypatch):
    paged = []
    monkeypatch.setattr(resident, "page_out", lambda tensor: paged.append(tensor) or 0)
    tied = tiny_model("qwen2")
    tied.lm_head.weight = tied.get_input_embeddings().weight
    page_out_input_embeddings(tied)
    assert paged == []
    untied = tiny_model("qwen2")
    untied.lm_head.weight = torch.nn.Parameter(untied.get_input_embeddings().weight.detach().clone())
    page_out_input_embeddings(untied)
    assert len(paged) == 1 and paged[0].data_ptr() == untied.get_input_embeddings().weight.data_ptr()


@linux
def test_trimming_the_heap_keeps_what_is_in_use():
    kept = [torch.randn(4096) for _ in range(64)]
    copies = [t.clone() for t in kept]
    freed = [torch.randn(1 << 16) for _ in range(64)]
    del freed
    c_heap.trim()
    assert all(torch.equal(a, b) for a, b in zip(kept, copies))
