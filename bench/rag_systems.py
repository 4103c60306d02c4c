"""The systems the RAG benchmark compares, each behind the same small interface.

Every system answers one prompt with greedy decoding and reports a :class:`Completion`. TTFT
is measured the same way for all of them: wall time from the call (before tokenizing) until
the first generated token reaches the caller (a streamed piece, a streamer ``put``, an
``on_token`` callback). Warming is timed apart and never counted in TTFT.

- :class:`TransformersGenerate`: full prefill with ``model.generate`` (what
  ``HuggingFacePipeline`` and ``HuggingFaceLLM`` run).
- :class:`PrefixCacheGenerate`: longest-token-prefix K/V reuse on a plain ``DynamicCache``,
  the behaviour of vLLM automatic prefix caching and SGLang's radix cache.
- :class:`PyPIKVBoost`: the ``kvboost`` package from PyPI through its own API (optional).
- :class:`KVBoostRagSystem`: kvboost-rag with one repair strategy and recompute ratio.
- :class:`LangChainSystem` / :class:`LlamaIndexSystem`: kvboost-rag through the adapters.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from kvboost_rag.decode.sampling import eos_token_ids

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    """One system's answer to one prompt.

    Attributes:
        ttft_ms: Wall time from the call to the first generated token reaching the caller.
        text: Generated text (special tokens dropped).
        token_ids: Generated token ids without the end-of-sequence token; ``None`` when the
            system exposes only text (the adapters).
        first_logits: Next-token logits at the end of the prompt; ``None`` when not exposed.
        prompt_tokens: Tokens in the prompt.
        reuse: Share of prompt tokens whose K/V came from cache.
        reported_ttft_ms: TTFT as the system itself reports it, when it does.
    """

    ttft_ms: float
    text: str
    token_ids: list[int] | None
    first_logits: torch.Tensor | None
    prompt_tokens: int
    reuse: float = 0.0
    reported_ttft_ms: float | None = None


@dataclass
class SystemInfo:
    """How a system is labelled in tables and plots.

    Attributes:
        name: Row label.
        family: ``"baseline"``, ``"kvboost-rag"``, ``"adapter"`` or ``"pypi"``.
        strategy: Repair strategy for kvboost-rag rows (``"none"``, ``"selective"``,
            ``"cacheblend"``, ``"attention"``), else ``None``.
        ratio: Recompute ratio for kvboost-rag rows.
    """

    name: str
    family: str
    strategy: str | None = None
    ratio: float | None = None


class System:
    """Interface of a benchmarked system."""

    info: SystemInfo

    def warm(self, head: str, documents: Sequence[str]) -> float:
        """Prepare for prompts that start with ``head`` and contain ``documents``.

        Returns:
            Seconds spent (0 when the system keeps nothing between calls).
        """
        return 0.0

    def run(self, prompt: str, max_new_tokens: int) -> Completion:
        """Answer ``prompt`` greedily with up to ``max_new_tokens`` tokens."""
        raise NotImplementedError


class FirstTokenStreamer(BaseStreamer):
    """A transformers streamer that records when the first generated token arrives.

    ``generate`` calls ``put`` once with the prompt ids, then once per generated token.
    """

    def __init__(self) -> None:
        self._prompt_seen = False
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:  # noqa: D102
        if not self._prompt_seen:
            self._prompt_seen = True
        elif self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:  # noqa: D102
        pass


def strip_eos(token_ids: Iterable[int], eos: Iterable[int]) -> list[int]:
    """Token ids up to (not including) the first end-of-sequence id."""
    stop = set(eos)
    out: list[int] = []
    for token in token_ids:
        if token in stop:
            break
        out.append(int(token))
    return out


class TransformersGenerate(System):
    """Full prefill with plain ``model.generate``, timed to the first streamed token.

    Args:
        model: The causal LM.
        tokenizer: Its tokenizer.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.info = SystemInfo("transformers generate (full prefill)", "baseline")
        self.model = model
        self.tokenizer = tokenizer
        self.eos = sorted(eos_token_ids(model, tokenizer))

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """Greedy decoding that returns the first-token logits and the cache."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        start = time.perf_counter()
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.model.device)
        completion, _ = self._generate(ids, None, max_new_tokens, start)
        return completion

    def _generate(
        self, ids: torch.Tensor, cache: DynamicCache | None, max_new_tokens: int, start: float
    ) -> tuple[Completion, Any]:
        """Run ``generate`` on ``ids`` (on top of ``cache`` when given); returns the raw output too."""
        streamer = FirstTokenStreamer()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                generation_config=self.generation_config(max_new_tokens),
                streamer=streamer,
            )
        first = streamer.first_token_at or time.perf_counter()
        n = ids.shape[1]
        generated = strip_eos(out.sequences[0, n:].tolist(), self.eos)
        completion = Completion(
            ttft_ms=(first - start) * 1000,
            text=self.tokenizer.decode(generated, skip_special_tokens=True),
            token_ids=generated,
            first_logits=out.logits[0][0].detach().float().cpu(),
            prompt_tokens=n,
        )
        return completion, out


@dataclass
class _PrefixEntry:
    ids: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixKVStore:
    """Token sequences with their K/V; answers the longest cached token prefix of a prompt.

    Like a radix cache: an inserted sequence replaces the entries it extends, and the least
    recently used entries are dropped beyond ``max_bytes``.

    Args:
        max_bytes: Memory budget of the stored K/V.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _PrefixEntry] = OrderedDict()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, ids: torch.Tensor, limit: int) -> tuple[_PrefixEntry | None, int]:
        """The entry sharing the longest token prefix with ``ids`` and that length (<= ``limit``)."""
        best, best_len, best_key = None, 0, None
        for key, entry in self._entries.items():
            m = min(len(entry.ids), len(ids), limit)
            differ = (entry.ids[:m] != ids[:m]).nonzero()
            common = int(differ[0]) if differ.numel() else m
            if common > best_len:
                best, best_len, best_key = entry, common, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best, best_len

    def insert(self, ids: torch.Tensor, cache: DynamicCache) -> None:
        """Store ``ids`` with the K/V of ``cache`` (which covers exactly those tokens)."""
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        for key in [
            k for k, e in self._entries.items() if len(e.ids) <= len(ids) and torch.equal(e.ids, ids[: len(e.ids)])
        ]:
            del self._entries[key]
        self._entries[self._next_id] = _PrefixEntry(ids.clone(), keys, values)
        self._next_id += 1
        while len(self._entries) > 1 and sum(e.nbytes for e in self._entries.values()) > self.max_bytes:
            self._entries.popitem(last=False)


class PrefixCacheGenerate(TransformersGenerate):
    """Prefix-only caching: copy the K/V of the longest cached token prefix, prefill the rest.

    After each call the prompt and the generated tokens are stored (as vLLM APC and SGLang do),
    so a later prompt that extends them (a chat turn) hits the whole history.

    Args:
        model: The causal LM.
        tokenizer: Its tokenizer.
        max_bytes: Memory budget of the prefix store.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_bytes: int = 2 * 1024**3) -> None:
        super().__init__(model, tokenizer)
        self.info = SystemInfo("prefix caching (vLLM APC / SGLang radix style)", "baseline")
        self.store = PrefixKVStore(max_bytes)

    def warm(self, head: str, documents: Sequence[str]) -> float:
        """Cache ``head`` and ``head + document`` for each document.

        A prompt whose first document is one of them then hits through the end of that document.
        """
        start = time.perf_counter()
        for text in [head, *(head + doc for doc in documents)]:
            ids = self.tokenizer(text, return_tensors="pt").input_ids.to(self.model.device)
            found, length = self.store.longest_prefix(ids[0], ids.shape[1])
            if length == ids.shape[1]:
                continue
            cache = self._cache_for(found, length)
            with torch.no_grad():
                self.model(input_ids=ids[:, length:], past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.store.insert(ids[0], cache)
        return time.perf_counter() - start

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        start = time.perf_counter()
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.model.device)
        found, length = self.store.longest_prefix(ids[0], ids.shape[1] - 1)
        cache = self._cache_for(found, length)
        completion, out = self._generate(ids, cache, max_new_tokens, start)
        completion.reuse = length / ids.shape[1]
        kept = out.past_key_values.get_seq_length()
        self.store.insert(out.sequences[0, :kept], out.past_key_values)
        return completion

    @staticmethod
    def _cache_for(entry: _PrefixEntry | None, length: int) -> DynamicCache:
        """A fresh cache holding a copy of the first ``length`` tokens of ``entry``."""
        cache = DynamicCache()
        if entry is None or length == 0:
            return cache
        for layer, (k, v) in enumerate(zip(entry.keys, entry.values)):
            cache.update(k[:, :, :length].clone(), v[:, :, :length].clone(), layer)
        return cache


class PyPIKVBoost(System):
    """The PyPI ``kvboost`` package through its own API (``warm`` + chunk-reuse ``generate``).

    Args:
        model: The causal LM (shared; kvboost patches nothing on CPU).
        tokenizer: Its tokenizer.
        strategy: kvboost's recompute strategy.
        ratio: kvboost's CacheBlend recompute ratio.

    Raises:
        ImportError: ``kvboost`` is not installed.
    """

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, strategy: str = "cacheblend", ratio: float = 0.15
    ) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import kvboost
            from kvboost import GenerationMode

        from importlib import metadata

        version = metadata.version("kvboost")
        logging.getLogger("kvboost").setLevel(logging.ERROR)
        self.info = SystemInfo(f"kvboost {version} (PyPI) {strategy} {round(ratio * 100)}%", "pypi", strategy, ratio)
        self._mode = GenerationMode.CHUNK_KV_REUSE
        self.engine = kvboost.KVBoost(
            model,
            tokenizer,
            max_cache_bytes=2 * 1024**3,
            recompute_strategy=strategy,
            recompute_ratio=ratio,
            device=str(model.device),
        )
        self.eos = sorted(eos_token_ids(model, tokenizer))

    def warm(self, head: str, documents: Sequence[str]) -> float:
        """Warm the shared head and each document, as kvboost's README does."""
        start = time.perf_counter()
        for text in [head, *documents]:
            self.engine.warm(text)
        return time.perf_counter() - start

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        tokens: list[int] = []
        arrivals: list[float] = []

        def on_token(token: int) -> None:
            if not arrivals:
                arrivals.append(time.perf_counter())
            tokens.append(int(token))

        start = time.perf_counter()
        result = self.engine.generate(
            prompt, max_new_tokens=max_new_tokens, mode=self._mode, do_sample=False, on_token=on_token
        )
        first = arrivals[0] if arrivals else time.perf_counter()
        generated = strip_eos(tokens, self.eos)
        logits = result.first_token_logits
        return Completion(
            ttft_ms=(first - start) * 1000,
            text=self.engine.tokenizer.decode(generated, skip_special_tokens=True),
            token_ids=generated,
            first_logits=None if logits is None else torch.from_numpy(logits).float(),
            prompt_tokens=int(result.prompt_tokens),
            reuse=float(result.kv_reuse_ratio),
            reported_ttft_ms=float(result.ttft_ms),
        )


def apply_strategy(engine: Any, strategy: str, ratio: float) -> None:
    """Set the engine's repair strategy and recompute ratio for the next calls."""
    engine.settings.recompute_strategy = strategy
    engine.settings.recompute_ratio = ratio


def strategy_label(strategy: str, ratio: float) -> str:
    """Row label of a kvboost-rag strategy (``"cacheblend 15%"``, ``"none"``)."""
    return "none" if strategy == "none" else f"{strategy} {round(ratio * 100)}%"


class EngineWarmer:
    """Warms a kvboost-rag engine once for all the systems that share it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._warmed: set[str] = set()

    def warm(self, head: str, documents: Sequence[str]) -> float:
        """Warm ``head`` (exact prefix) and the documents not warmed yet; returns seconds."""
        start = time.perf_counter()
        if head not in self._warmed:
            self.engine.warm(head)
            self._warmed.add(head)
        new = [d for d in dict.fromkeys(documents) if d not in self._warmed]
        if new:
            self.engine.warm_documents(new, show_progress=False)
            self._warmed.update(new)
        return time.perf_counter() - start


class KVBoostRagSystem(System):
    """kvboost-rag called directly, through ``engine.stream``.

    Args:
        engine: The shared ``KVBoost`` engine.
        warmer: The engine's shared warmer.
        strategy: Repair strategy.
        ratio: Recompute ratio.
    """

    def __init__(self, engine: Any, warmer: EngineWarmer, strategy: str, ratio: float) -> None:
        self.info = SystemInfo(f"kvboost-rag {strategy_label(strategy, ratio)}", "kvboost-rag", strategy, ratio)
        self.engine = engine
        self.warmer = warmer
        self.strategy, self.ratio = strategy, ratio

    def warm(self, head: str, documents: Sequence[str]) -> float:  # noqa: D102
        return self.warmer.warm(head, documents)

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        apply_strategy(self.engine, self.strategy, self.ratio)
        start = time.perf_counter()
        stream = self.engine.stream(prompt, max_new_tokens=max_new_tokens, return_logits=True)
        first = None
        for _ in stream:
            if first is None:
                first = time.perf_counter()
        first = first or time.perf_counter()
        result = stream.result
        return Completion(
            ttft_ms=(first - start) * 1000,
            text=result.output_text,
            token_ids=list(result.token_ids),
            first_logits=result.first_token_logits.float(),
            prompt_tokens=result.prompt_tokens,
            reuse=result.kv_reuse_ratio,
            reported_ttft_ms=result.ttft_ms,
        )


class _AdapterSystem(System):
    """Shared parts of the adapter rows: engine settings, warming, re-tokenized output."""

    def __init__(self, name: str, engine: Any, warmer: EngineWarmer, strategy: str, ratio: float) -> None:
        self.info = SystemInfo(f"{name} ({strategy_label(strategy, ratio)})", "adapter", strategy, ratio)
        self.engine = engine
        self.warmer = warmer
        self.strategy, self.ratio = strategy, ratio

    def warm(self, head: str, documents: Sequence[str]) -> float:  # noqa: D102
        return self.warmer.warm(head, documents)

    def _completion(self, start: float, first: float | None, text: str, info: dict[str, Any]) -> Completion:
        first = first or time.perf_counter()
        return Completion(
            ttft_ms=(first - start) * 1000,
            text=text,
            token_ids=None,
            first_logits=None,
            prompt_tokens=int(info.get("prompt_tokens", 0)),
            reuse=float(info.get("kv_reuse_ratio", 0.0)),
            reported_ttft_ms=info.get("ttft_ms"),
        )


class LangChainSystem(_AdapterSystem):
    """kvboost-rag through ``langchain_kvboost.KVBoostLLM.stream``.

    Raises:
        ImportError: ``langchain_kvboost`` cannot be imported.
    """

    def __init__(self, engine: Any, warmer: EngineWarmer, strategy: str, ratio: float) -> None:
        from langchain_kvboost import KVBoostLLM

        super().__init__("langchain_kvboost.KVBoostLLM", engine, warmer, strategy, ratio)
        self._llm = KVBoostLLM(engine=engine)
        self._handler = _capture_handler()

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        apply_strategy(self.engine, self.strategy, self.ratio)
        self._handler.info = {}
        start = time.perf_counter()
        first = None
        pieces = []
        config = {"callbacks": [self._handler]}
        for piece in self._llm.stream(prompt, config=config, max_new_tokens=max_new_tokens):
            if first is None:
                first = time.perf_counter()
            pieces.append(piece)
        return self._completion(start, first, "".join(pieces), self._handler.info)


def _capture_handler() -> Any:
    """A LangChain callback handler keeping the last run's ``generation_info``."""
    from langchain_core.callbacks import BaseCallbackHandler

    class _Capture(BaseCallbackHandler):
        info: dict[str, Any] = {}

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            generation = response.generations[0][0]
            self.info = dict(generation.generation_info or {})

    return _Capture()


class LlamaIndexSystem(_AdapterSystem):
    """kvboost-rag through ``llama_index.llms.kvboost.KVBoostLLM.stream_complete``.

    Raises:
        ImportError: ``llama_index.llms.kvboost`` cannot be imported.
    """

    def __init__(self, engine: Any, warmer: EngineWarmer, strategy: str, ratio: float) -> None:
        from llama_index.llms.kvboost import KVBoostLLM

        super().__init__("llama_index KVBoostLLM", engine, warmer, strategy, ratio)
        self._llm = KVBoostLLM(engine=engine, set_global_tokenizer=False)

    def run(self, prompt: str, max_new_tokens: int) -> Completion:  # noqa: D102
        apply_strategy(self.engine, self.strategy, self.ratio)
        start = time.perf_counter()
        first = None
        last = None
        for response in self._llm.stream_complete(prompt, formatted=True, max_new_tokens=max_new_tokens):
            if first is None:
                first = time.perf_counter()
            last = response
        text = last.text if last is not None else ""
        return self._completion(start, first, text, dict(last.raw or {}) if last is not None else {})
