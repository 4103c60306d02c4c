"""Constrained-decoding libraries side by side on CPU, with the embedded model's tokenizer.

For xgrammar, outlines-core and llguidance this times, in one run and on the same tokens:

- ``setup ms``: building the library's view of the 49k-token vocabulary (once per tokenizer);
- ``compile ms``: turning a tool-call JSON schema into a matcher (once per request or schema);
- ``mask us/token``: per decoded token, computing the allowed-token bitmask, applying it to a
  ``[vocab]`` float32 logits row and advancing the matcher with the chosen token (median over
  the tokens of a valid tool call, repeated ``--repeats`` times);
- ``% of decode step``: that cost against one decode step (one token forward pass) of the
  embedded SmolLM2-135M-Instruct on the same machine, timed in the same run.

A last row times the engine's own hook on the same schema: ``GrammarGuide.mask`` and
``advance`` (llguidance filling its bitmask and applying it with ``llguidance.torch``), which is what
``GenerationOptions.constraint`` costs per token. It drives the engine's JSON layout
(``", "`` and ``": "`` separators), so its token sequence is a few tokens longer.

Libraries that are not installed are skipped with a line saying so. The engine uses
llguidance (``pip install kvboost-rag[constrained]``); the others are compared here only.

Run: ``python bench/constraint_bench.py`` (CPU, 1 thread by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

#: A tool call's JSON schema, the shape ``bind_tools`` constrains decoding to.
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "search_python_docs"},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "top_k": {"type": "integer"},
                "section": {"enum": ["reference", "library", "tutorial"]},
            },
            "required": ["query", "top_k", "section"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

#: A valid instance, tokenized to drive every matcher through the same tokens.
TOOL_CALL = {
    "name": "search_python_docs",
    "arguments": {"query": "how do context managers close files", "top_k": 3, "section": "reference"},
}


class Candidate:
    """One library: ``setup`` builds the vocabulary view, ``compile`` a fresh matcher, and
    ``step(matcher, logits, token)`` masks the logits and advances the matcher."""

    def __init__(self, name: str, setup: Callable[[], Any], compile: Callable[[Any], Any], step: Callable[..., None]):
        self.name = name
        self.setup = setup
        self.compile = compile
        self.step = step


def llguidance_candidate(tokenizer: Any, vocab: int) -> Candidate:
    import llguidance
    import llguidance.hf

    grammar = llguidance.LLMatcher.grammar_from_json_schema(TOOL_CALL_SCHEMA)
    shifts = torch.arange(32, dtype=torch.int32)

    def setup() -> Any:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(info: Any) -> Any:
        matcher = llguidance.LLMatcher(info, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def step(matcher: Any, logits: torch.Tensor, token: int) -> None:
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(-1)[: logits.shape[-1]]
        logits.masked_fill_(~allowed, float("-inf"))
        assert matcher.consume_token(token), matcher.get_error()

    return Candidate("llguidance", setup, compile, step)


def xgrammar_candidate(tokenizer: Any, vocab: int) -> Candidate:
    import xgrammar

    def setup() -> Any:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        return xgrammar.GrammarCompiler(info, cache_enabled=False), xgrammar.allocate_token_bitmask(1, vocab)

    def compile(state: Any) -> Any:
        compiler, bitmask = state
        compiled = compiler.compile_json_schema(json.dumps(TOOL_CALL_SCHEMA), any_whitespace=False, separators=(",", ":"))
        return xgrammar.GrammarMatcher(compiled), bitmask

    def step(state: Any, logits: torch.Tensor, token: int) -> None:
        matcher, bitmask = state
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask, backend="cpu")
        assert matcher.accept_token(token)

    return Candidate("xgrammar", setup, compile, step)


def outlines_candidate(tokenizer: Any, vocab: int) -> Candidate:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    regex = build_regex_from_schema(json.dumps(TOOL_CALL_SCHEMA), whitespace_pattern="")
    eos = int(tokenizer.eos_token_id)
    shifts = torch.arange(32, dtype=torch.int32)

    def setup() -> Any:
        # Byte-level BPE token strings back to the bytes they stand for.
        byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        specials = set(tokenizer.all_special_ids)
        mapping: dict[bytes, list[int]] = {}
        for text, token_id in tokenizer.get_vocab().items():
            if token_id in specials or token_id == eos:
                continue
            mapping.setdefault(bytes(byte_of[c] for c in text), []).append(token_id)
        return outlines_core.Vocabulary(eos, mapping)

    def compile(vocabulary: Any) -> Any:
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
        return guide, torch.zeros(((vocab + 31) // 32,), dtype=torch.int32)

    def step(state: Any, logits: torch.Tensor, token: int) -> None:
        guide, words = state
        guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(-1)[: logits.shape[-1]]
        logits.masked_fill_(~allowed, float("-inf"))
        guide.advance(token)

    return Candidate("outlines-core", setup, compile, step)


def engine_hook_candidate(tokenizer: Any, vocab: int) -> Candidate:
    from kvboost_rag.decode.constrained import ConstraintCompiler, OutputConstraint

    def setup() -> Any:
        compiler = ConstraintCompiler(tokenizer, vocab, [int(tokenizer.eos_token_id)])
        compiler.compile(OutputConstraint.any_json_object())  # builds the tokenizer view
        return compiler

    def compile(compiler: Any) -> Any:
        return compiler.compile(OutputConstraint(json_schema=TOOL_CALL_SCHEMA))

    def step(guide: Any, logits: torch.Tensor, token: int) -> None:
        guide.mask(logits)
        guide.advance(token)

    return Candidate("kvboost-rag hook", setup, compile, step)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(visible)
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(visible, (chr(c) for c in chars), strict=True))


def decode_step_ms(model: Any, tokenizer: Any, repeats: int) -> float:
    """Median milliseconds of one decode step of ``model`` after a short prompt."""
    from transformers import DynamicCache

    ids = torch.tensor([tokenizer("Explain context managers in Python.")["input_ids"]])
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return statistics.median(times[1:]) * 1000


def measure(candidate: Candidate, tokens: list[int], vocab: int, repeats: int) -> dict[str, float]:
    start = time.perf_counter()
    prepared = candidate.setup()
    setup_ms = (time.perf_counter() - start) * 1000
    compile_times, step_times = [], []
    logits = torch.randn(vocab)
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = candidate.compile(prepared)
        compile_times.append(time.perf_counter() - start)
        for token in tokens:
            row = logits.clone()
            start = time.perf_counter()
            candidate.step(matcher, row, token)
            step_times.append(time.perf_counter() - start)
    return {
        "setup_ms": setup_ms,
        "compile_ms": statistics.median(compile_times) * 1000,
        "mask_us": statistics.median(step_times) * 1e6,
        "mask_p90_us": statistics.quantiles(step_times, n=10)[-1] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="passes over the tool call's tokens per library")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvboost_rag.default_model import default_model_dir

    path = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = int(model.config.vocab_size)
    tokens = tokenizer(json.dumps(TOOL_CALL, separators=(",", ":")), add_special_tokens=False)["input_ids"]
    step_ms = decode_step_ms(model, tokenizer, repeats=20)

    print(f"tokenizer: {path.name} ({vocab} tokens); tool call of {len(tokens)} tokens; "
          f"torch threads: {args.threads}; decode step of the model: {step_ms:.1f} ms")
    print()
    print("| library | version | setup ms | compile ms | mask us/token (median) | p90 | % of decode step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    builders = {
        "llguidance": llguidance_candidate,
        "xgrammar": xgrammar_candidate,
        "outlines-core": outlines_candidate,
        "kvboost-rag hook": engine_hook_candidate,
    }
    spaced = tokenizer(json.dumps(TOOL_CALL), add_special_tokens=False)["input_ids"]
    from importlib.metadata import PackageNotFoundError, version

    for name, build in builders.items():
        try:
            candidate = build(tokenizer, vocab)
        except ImportError as exc:
            print(f"| {name} | not installed ({exc.name}) | | | | | |")
            continue
        row = measure(candidate, spaced if name == "kvboost-rag hook" else tokens, vocab, args.repeats)
        try:
            release = version("llguidance" if name == "kvboost-rag hook" else name)
        except PackageNotFoundError:
            release = "?"
        print(
            f"| {name} | {release} | {row['setup_ms']:.0f} | {row['compile_ms']:.1f} | {row['mask_us']:.0f} | "
            f"{row['mask_p90_us']:.0f} | {100 * row['mask_us'] / 1000 / step_ms:.1f}% |"
        )


if __name__ == "__main__":
    main()
