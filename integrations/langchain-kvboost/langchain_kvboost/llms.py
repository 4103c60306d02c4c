"""``KVBoostLLM``: a text-completion LLM on a local HuggingFace model with K/V reuse."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from kvboost_rag import InvalidInputError
from kvboost_rag.integration import iterate_in_thread
from kvboost_rag.integration.dropin import (
    device_setting,
    generation_fields,
    model_settings,
)
from kvboost_rag.integration.usage import result_figures, usage
from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from langchain_kvboost._common import KVBoostParams

logger = logging.getLogger(__name__)


class KVBoostLLM(KVBoostParams, BaseLLM):
    """Local HuggingFace causal LM whose prompts reuse cached K/V of text read before.

    A drop-in replacement for ``HuggingFacePipeline`` in RAG chains: a prompt that starts
    with a warmed system prompt reuses it by exact prefix, and documents that were prewarmed
    (see ``KVBoostPrewarmer``) or passed as ``documents`` are served from cache wherever they
    land in the prompt, in any order.

    Setup:
        .. code-block:: bash

            pip install -e integrations/langchain-kvboost

    Instantiate:
        .. code-block:: python

            from langchain_kvboost import KVBoostLLM

            llm = KVBoostLLM()                               # embedded SmolLM2-135M-Instruct
            llm = KVBoostLLM(model="path/to/hf/folder", max_new_tokens=128)
            llm = KVBoostLLM(engine=engine)                  # an existing kvboost_rag.KVBoost
            llm = KVBoostLLM.from_model_id(                  # as with HuggingFacePipeline
                model_id="path/to/hf/folder", task="text-generation",
                pipeline_kwargs={"max_new_tokens": 64, "temperature": 0.7, "do_sample": True},
                device=0,
            )

    Invoke:
        .. code-block:: python

            llm.invoke("The capital of France is", max_new_tokens=8)
            result = llm.generate(["Question: ..."])
            result.generations[0][0].generation_info["ttft_ms"]

    Explicit documents (cut on their boundaries and stored for the next prompt):
        .. code-block:: python

            llm.invoke(prompt, documents=[doc1, doc2])
            llm.invoke(prompt, config={"metadata": {"documents": [doc1, doc2]}})

    ``generation_info`` of each generation holds the figures of the engine's result
    (``kvboost_rag.integration.usage.RESULT_FIGURES``: ``ttft_ms``, ``total_ms``,
    ``prompt_tokens``, ``generated_tokens``, ``cached_tokens``, ``kv_reuse_ratio``,
    ``documents_found``, ``finish_reason``, ...); ``llm_output["token_usage"]`` the usage of
    all prompts (``kvboost_rag.integration.usage.usage``).
    """

    # The LangChain base classes ignore unknown fields; a misspelt parameter should fail.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        task: str = "text-generation",
        backend: str = "default",
        device: int | str | None = None,
        device_map: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        pipeline_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> KVBoostLLM:
        """Build it as ``HuggingFacePipeline.from_model_id`` is called.

        Args:
            model_id: Local model folder, or a model id already in the local HuggingFace cache.
            task: ``"text-generation"`` (the only task a causal LM serves here).
            backend: ``"default"`` or ``"pt"`` (PyTorch).
            device: ``-1`` (CPU), a CUDA index, or a device string.
            device_map: ``"auto"`` or one device (``"cuda"``, ``"cpu"``).
            model_kwargs: ``{"torch_dtype": ...}`` (or ``dtype``).
            pipeline_kwargs: Generation arguments: ``max_new_tokens``, ``temperature``,
                ``top_p``, ``do_sample``, ``seed`` (``return_full_text=False`` is accepted:
                answers never repeat the prompt).
            **kwargs: Other ``KVBoostLLM`` fields (``engine_settings``, ``stop``, ...).

        Raises:
            kvboost_rag.InvalidInputError: A task, backend or argument the engine does not
                implement; the message names what to use instead.
        """
        if task != "text-generation":
            raise InvalidInputError(
                f"task={task!r} is not supported: kvboost serves causal LMs (task='text-generation'); "
                "use HuggingFacePipeline for other tasks"
            )
        if backend not in ("default", "pt"):
            raise InvalidInputError(f"backend={backend!r} is not supported; kvboost runs PyTorch (backend='default')")
        if "batch_size" in kwargs:
            raise InvalidInputError(
                "batch_size is not supported: prompts are answered one at a time (each reuses the K/V "
                "the previous ones stored); drop batch_size"
            )
        settings = dict(kwargs.pop("engine_settings", None) or {})
        settings.update(model_settings(model_kwargs))
        chosen = device_setting(device, device_map)
        if chosen is not None:
            settings["device"] = chosen
        fields = {**generation_fields(pipeline_kwargs, "pipeline_kwargs"), **kwargs}
        return cls(model=model_id, engine_settings=settings or None, **fields)

    @property
    def _llm_type(self) -> str:
        return "kvboost"

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        return self._params_dict()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._langsmith_params("llm", stop, **kwargs)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the model's own tokenizer (no special tokens)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(self.engine.token_ids(text))

    def get_num_tokens(self, text: str) -> int:
        """Number of model tokens in ``text``."""
        if self.custom_get_token_ids is not None:
            return len(self.custom_get_token_ids(text))
        return int(self.engine.count_tokens(text))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if not prompts:
            raise ValueError("KVBoostLLM got an empty list of prompts; pass at least one prompt.")
        params = self._call_params(stop, kwargs, run_manager.metadata if run_manager else None)
        if self.streaming:
            outputs = [self._generate_streaming(prompt, params, run_manager) for prompt in prompts]
        else:
            outputs = [self._text_and_result(result) for result in self.engine.generate_batch(prompts, **params)]
        generations: list[list[Generation]] = []
        for text, result in outputs:
            logger.debug(
                "kvboost: ttft %.0f ms, %d/%d prompt tokens from cache",
                result.ttft_ms,
                result.cached_tokens,
                result.prompt_tokens,
            )
            generations.append([Generation(text=text, generation_info=result_figures(result))])
        return LLMResult(
            generations=generations,
            llm_output={"model_name": self.model_name, "token_usage": usage(result for _, result in outputs)},
        )

    @staticmethod
    def _text_and_result(result: Any) -> tuple[str, Any]:
        """One entry of ``generate_batch``: its text and result, or the error that failed it.

        Raises:
            Exception: The prompt's own error (LangChain has no per-prompt error in one
                ``_generate``; ``batch(..., return_exceptions=True)`` reports it for every input).
        """
        if isinstance(result, Exception):
            raise result
        return result.output_text, result

    def _generate_streaming(
        self,
        prompt: str,
        params: dict[str, Any],
        run_manager: CallbackManagerForLLMRun | None,
    ) -> tuple[str, Any]:
        stream = self.engine.stream(prompt, **params)
        pieces: list[str] = []
        for piece in stream:
            pieces.append(piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=GenerationChunk(text=piece))
        return "".join(pieces), stream.result

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        params = self._call_params(stop, kwargs, run_manager.metadata if run_manager else None)
        stream = self.engine.stream(prompt, **params)
        for piece in stream:
            chunk = GenerationChunk(text=piece)
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=result_figures(stream.result))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        params = self._call_params(stop, kwargs, run_manager.metadata if run_manager else None)
        streams: list[Any] = []

        def start() -> Iterator[str]:
            # Built in the worker thread too: starting a stream may already run the prefill.
            streams.append(self.engine.stream(prompt, **params))
            return iter(streams[0])

        async for piece in iterate_in_thread(start):
            chunk = GenerationChunk(text=piece)
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=result_figures(streams[0].result))
