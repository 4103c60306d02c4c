"""Captured steps built in the background while the engine serves, and compiled code kept
across processes.

The engine answers at once with its eager path while a bucket is being built (a gate holds the
build), each bucket is used as soon as it is ready, the model the requests run is never switched
to the captured attention meanwhile, a failed bucket leaves the ready ones in use, steps that
record attention are used only once all their buckets are, and a second process finds the
first one's compiled code in the engine's cache folder (inductor on the CPU).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from devices import CUDA
from rag_prompts import rag_prompt

import kvboost_rag.engine as engine_module
from kvboost_rag import KVBoost
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.dev.threads import wait_for
from kvboost_rag.hf import ModelAdapter
from kvboost_rag.hf.captured import CapturedRows, SlotPool, build_captured_rows
from kvboost_rag.hf.captured.attention import ROWS_ATTENTION
from kvboost_rag.hf.captured.graph import CACHE_DIR_ENV, BucketGraph, keep_compiled_code_in
from kvboost_rag.decode_weights.int8_rows import int8_available

SETTINGS = dict(
    show_progress=False, chunk_size=32, captured_steps="on", captured_pool_bytes=16 * 2**20,
    captured_token_buckets=(1, 4), draft_tokens=0,
)


@pytest.fixture
def gated_buckets(monkeypatch):
    """``bucket -> event``: building a bucket waits until its event is set (all set on exit);
    the model's attention implementation is recorded while each bucket builds."""
    gates: dict[int, threading.Event] = {1: threading.Event(), 4: threading.Event(), 16: threading.Event()}
    seen: list[str] = []
    warm = BucketGraph.warm

    def gated(self, function, host_table):
        seen.append(_ENGINE_MODEL[0].config._attn_implementation)
        assert gates[self.bucket].wait(60), "the gate was never opened"
        built = warm(self, function, host_table)
        seen.append(_ENGINE_MODEL[0].config._attn_implementation)
        return built

    monkeypatch.setattr(BucketGraph, "warm", gated)
    monkeypatch.setattr(engine_module, "build_captured_rows", functools.partial(build_captured_rows, backend="aot_eager"))
    yield gates, seen
    for gate in gates.values():
        gate.set()


_ENGINE_MODEL: list = [None]  # the model whose attention the gate records


def _engine(tokenizer, **settings) -> KVBoost:
    model = tiny_model("llama")
    _ENGINE_MODEL[0] = model
    return KVBoost.from_model(model, tokenizer, **{**SETTINGS, **settings})


def test_requests_are_served_eagerly_while_buckets_build_and_captured_once_ready(tokenizer, docs, gated_buckets):
    gates, seen = gated_buckets
    eager = KVBoost.from_model(tiny_model("llama"), tokenizer, **{**SETTINGS, "captured_steps": "off"})
    engine = _engine(tokenizer)  # returns although the first bucket's build waits
    own = engine.model.config._attn_implementation
    prompt = rag_prompt(docs[:2])
    expected = eager.generate(prompt, max_new_tokens=8).token_ids
    assert engine.generate(prompt, max_new_tokens=8).token_ids == expected
    assert engine.captured_steps_run == 0 and engine._captured.ready_buckets == ()
    gates[1].set()  # bucket 1 ready: decode steps of one token run captured
    wait_for(lambda: engine._captured.ready_buckets == (1,))
    assert engine.generate(prompt, max_new_tokens=8).token_ids == expected
    runs = engine.captured_steps_run
    assert runs > 0
    gates[4].set()
    assert engine.wait_for_captured_steps(timeout=60) and engine._captured.ready_buckets == (1, 4)
    assert engine.generate(rag_prompt(docs[2:4]), max_new_tokens=6).token_ids == eager.generate(
        rag_prompt(docs[2:4]), max_new_tokens=6
    ).token_ids
    assert engine.captured_steps_run > runs
    # The build never switched the model requests run to the captured attention (their own
    # prefill switches it to the engine's sparse attention and back, on their thread).
    assert seen and ROWS_ATTENTION not in seen and engine.model.config._attn_implementation == own


def test_a_bucket_that_fails_leaves_the_ready_ones_in_use(tokenizer, docs, gated_buckets, monkeypatch, caplog):
    gates, _ = gated_buckets
    gates[1].set()
    warm = BucketGraph.warm

    def failing(self, function, host_table):
        if self.bucket == 4:
            raise RuntimeError("no kernel for this bucket")
        return warm(self, function, host_table)

    monkeypatch.setattr(BucketGraph, "warm", failing)
    engine = _engine(tokenizer)
    assert engine.wait_for_captured_steps(timeout=60)
    assert engine._captured.ready_buckets == (1,) and "no kernel" in engine._captured.reason
    assert "buckets [1] stay in use" in caplog.text
    engine.generate(rag_prompt(docs[:2]), max_new_tokens=4)
    assert engine.captured_steps_run > 0


@pytest.mark.skipif(not int8_available(), reason="no int8 kernel on this CPU: decode reads the model's weights either way")
@pytest.mark.parametrize(("decode_weights", "warned"), [("int8", True), ("stored", True), ("model", False), ("auto", False)])
def test_captured_steps_say_when_they_leave_the_decode_copies_unread(tokenizer, decode_weights, warned, caplog, monkeypatch):
    """Captured steps read the model's own weights: a decode_weights that eager steps would
    read as int8 or 4-bit copies is named in a warning (the tiny Llama is not an int8 default)."""
    monkeypatch.setattr(engine_module, "build_captured_rows", functools.partial(build_captured_rows, backend=None))
    engine = KVBoost.from_model(
        tiny_model("llama"), tokenizer, **{**SETTINGS, "captured_build": "at_load", "decode_weights": decode_weights}
    )
    assert engine.captured_steps_run == 0
    assert ("is not used" in caplog.text) is warned
    if warned:
        assert f"decode_weights={decode_weights!r}" in caplog.text and "captured_steps='off'" in caplog.text


def test_probe_passes_are_used_only_once_all_their_buckets_are(tokenizer, monkeypatch):
    """The probe's passes share one attention record: with bucket 16 built and bucket 64
    still building, none is used."""
    adapter = ModelAdapter(tiny_model("llama"), tokenizer)
    pool = SlotPool(adapter.layout, [256], adapter.dtype, adapter.device, 64)
    built_16, gate_64 = threading.Event(), threading.Event()
    warm = BucketGraph.warm

    def gated(self, function, host_table):
        if self.bucket == 64:
            assert gate_64.wait(60), "the gate was never opened"
        built = warm(self, function, host_table)
        if self.bucket == 16:
            built_16.set()
        return built

    monkeypatch.setattr(BucketGraph, "warm", gated)
    probe = CapturedRows(adapter, pool, (16, 64), backend="aot_eager", last_logits=True, record_queries=1)
    try:
        assert probe.prepare(background=True)
        assert built_16.wait(60)
        assert not probe.available and probe.max_tokens == 0
    finally:
        gate_64.set()
    assert probe.wait_until_built(60) and probe.ready_buckets == (16, 64)


def test_hooks_put_on_the_model_during_a_pass_do_not_fire_in_the_build_threads_view():
    """The view the steps build over keeps the hooks of when it was made; one a request puts on
    the model later (stopping after a layer, feeding a hidden state) stays the model's own."""
    import torch

    from kvboost_rag.hf.attention_switch import model_with_attention

    model = tiny_model("llama")
    view = model_with_attention(model, "sdpa")
    fired: list[str] = []
    handle = model.model.layers[0].register_forward_hook(lambda *_: fired.append("hook"))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        view(ids)
        assert fired == []
        model(ids)
    handle.remove()
    assert fired == ["hook"]


def test_compiled_code_goes_to_the_engines_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(CACHE_DIR_ENV, default_cache_dir())  # what importing torch's compiler writes
    assert keep_compiled_code_in(tmp_path / "ours") == tmp_path / "ours"
    assert os.environ[CACHE_DIR_ENV] == str(tmp_path / "ours")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "theirs"))
    assert keep_compiled_code_in(tmp_path / "ours") == tmp_path / "theirs"
    assert os.environ[CACHE_DIR_ENV] == str(tmp_path / "theirs")


_BUILD = textwrap.dedent(
    """
    from kvboost_rag import KVBoost
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer
    from kvboost_rag.hf.captured.graph import compile_cache_counts
    # One layer: 19 kernels for the C++ compiler instead of 26 (what is cached is the same).
    engine = KVBoost.from_model(
        tiny_model("llama", num_hidden_layers=1), tiny_tokenizer(), captured_steps="on", captured_build="at_load",
        captured_token_buckets=(1,), captured_pool_bytes=8 * 2**20, show_progress=False, check_layer=0,
    )
    assert engine._captured is not None and engine._captured.available, engine._captured
    print(*compile_cache_counts())
    """
)


@pytest.mark.slow
def test_a_second_process_finds_the_first_ones_compiled_code(tmp_path):
    """Inductor on the CPU, one bucket: the first process compiles into the engine's cache
    folder (under ``KVBOOST_RAG_HOME``), the second finds it there and compiles nothing."""
    env = {**os.environ, "KVBOOST_RAG_HOME": str(tmp_path)}
    env.pop(CACHE_DIR_ENV, None)
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        counts.append(tuple(int(x) for x in done.stdout.split()[-2:]))
    (hits1, misses1), (hits2, misses2) = counts
    assert misses1 >= 1 and hits2 >= 1 and misses2 == 0, counts
    assert (tmp_path / "torch-compile").is_dir()


@pytest.mark.parametrize("device", [CUDA])
def test_on_cuda_steps_built_in_the_background_decode_the_eager_tokens(tokenizer, docs, device):
    """The default on a GPU: inductor and CUDA graphs built on a thread of their own while the
    engine answers (eagerly, then captured): every answer is the eager engine's."""
    settings = dict(show_progress=False, chunk_size=32, device=device, captured_token_buckets=(1, 4), draft_tokens=0)
    eager = KVBoost.from_model(tiny_model("llama"), tokenizer, **settings, captured_steps="off")
    engine = KVBoost.from_model(tiny_model("llama"), tokenizer, **settings)
    prompts = [rag_prompt(docs[:2]), rag_prompt([docs[2]], "Summarize."), rag_prompt(docs[3:5])]
    expected = [eager.generate(p, max_new_tokens=12).token_ids for p in prompts]
    during = [engine.generate(p, max_new_tokens=12).token_ids for p in prompts]  # the build goes on meanwhile
    assert engine.wait_for_captured_steps(timeout=600) and engine._captured.ready_buckets == (1, 4)
    runs = engine.captured_steps_run
    after = [engine.generate(p, max_new_tokens=12).token_ids for p in prompts]
    assert during == expected and after == expected
    assert engine.captured_steps_run > runs
