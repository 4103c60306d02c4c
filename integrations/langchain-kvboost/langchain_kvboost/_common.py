"""Fields, validation and per-call parameter handling shared by ``KVBoostLLM`` and ``ChatKVBoost``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvboost_rag.integration import call_in_thread
from kvboost_rag.integration.engine_registry import ArgumentNames, resolve_engine
from kvboost_rag.integration.params import (
    DocumentConverter,
    call_params,
    resolve_aliases,
)
from langchain_core.documents import Document
from langchain_core.language_models import LangSmithParams
from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

#: How these classes name the engine sources, so the resolver's errors name the fix.
_ENGINE_ARGUMENTS = ArgumentNames(model_path="model")

#: Key of the run config metadata (``config={"metadata": {...}}``) holding explicit documents.
DOCUMENTS_METADATA_KEY = "documents"

#: Parameters of hosted chat APIs that LangChain tooling passes by habit; they mean nothing to
#: a model that runs in this process, so they are accepted and dropped.
_REMOTE_ONLY_PARAMS = ("api_key", "timeout", "max_retries", "base_url")

#: Keyword arguments LangChain core itself may pass down to ``_generate`` / ``_stream``.
_CORE_KWARGS = ("stream",)

#: A LangChain ``Document`` in ``documents=`` stands for its ``page_content``.
LANGCHAIN_DOCUMENTS = DocumentConverter(
    lambda item: item.page_content if isinstance(item, Document) else None, "str or Document"
)


class KVBoostParams(BaseModel):
    """Engine selection and generation parameters common to the LLM and the chat model."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)

    engine: Any = Field(default=None, exclude=True)
    """A ready ``kvboost_rag.KVBoost``. When unset, one is built from ``model`` and
    ``engine_settings`` (and shared with other objects built from the same two)."""

    model: str | None = None
    """Path of a local HuggingFace model folder; ``None`` uses the embedded default model
    (SmolLM2-135M-Instruct)."""

    engine_settings: dict[str, Any] | None = None
    """``kvboost_rag.KVBoostSettings`` fields for an engine built here, e.g.
    ``{"recompute_ratio": 0.1, "disk_cache_dir": "kv"}``."""

    max_new_tokens: int = Field(default=256, ge=1)
    """Most tokens to generate. ``max_tokens`` is accepted as another name for it."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 decodes greedily."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (used when ``temperature`` > 0)."""

    repetition_penalty: float = Field(default=1.0, ge=1.0)
    """Above 1, lowers the logits of tokens the answer already holds (prompt tokens are not
    penalized). About 1.2 keeps small models from looping inside structured outputs."""

    seed: int | None = None
    """Seed of the sampler, for reproducible sampled outputs."""

    stop: list[str] | None = None
    """Stop strings: the output is cut before the first one and decoding stops there. A
    ``stop`` given at call time replaces this list."""

    reuse: bool = True
    """Serve cached K/V of prefixes and documents; ``False`` runs a full prefill (useful as a
    baseline)."""

    streaming: bool = False
    """Generate through the streaming path, so callbacks see each new token."""

    @model_validator(mode="before")
    @classmethod
    def _normalize_init_params(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = dict(values)
        dropped = [name for name in _REMOTE_ONLY_PARAMS if name in values]
        for name in dropped:
            values.pop(name)
        if dropped:
            logger.debug("%s runs locally; ignoring %s", cls.__name__, ", ".join(dropped))
        return resolve_aliases(values)

    @model_validator(mode="after")
    def _attach_engine(self) -> KVBoostParams:
        self.engine = resolve_engine(
            self.engine, model_path=self.model, settings=self.engine_settings, names=_ENGINE_ARGUMENTS
        )
        return self

    @property
    def max_tokens(self) -> int:
        """Alias of ``max_new_tokens`` (the LangChain standard parameter name)."""
        return self.max_new_tokens

    @property
    def model_name(self) -> str:
        """Name of the model the engine runs."""
        return str(self.engine.model_name)

    def _langsmith_params(self, model_type: str, stop: list[str] | None, **kwargs: Any) -> LangSmithParams:
        """Tracing parameters shared by the LLM and the chat model."""
        params = LangSmithParams(
            ls_provider="kvboost",
            ls_model_name=kwargs["model"] if isinstance(kwargs.get("model"), str) else self.model_name,
            ls_model_type=model_type,
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_new_tokens") or kwargs.get("max_tokens") or self.max_new_tokens,
        )
        ls_stop = stop if stop is not None else self.stop
        if ls_stop:
            params["ls_stop"] = ls_stop
        return params

    def _params_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "reuse": self.reuse,
        }

    def _call_params(
        self,
        stop: list[str] | None,
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Keyword arguments for ``engine.generate``/``engine.stream`` for one call.

        Args:
            stop: Stop strings given at call time; they replace ``self.stop``.
            kwargs: Per-call parameters (``kvboost_rag.integration.params.CALL_PARAMETERS``).
            metadata: Run metadata; its ``"documents"`` entry names explicit documents when
                no ``documents`` keyword is given.

        Raises:
            kvboost_rag.integration.UnknownParameterError: An unknown keyword.
            ValueError: Conflicting ``max_tokens``/``max_new_tokens``.
            TypeError: ``documents`` is not a list of strings or ``Document`` objects.
        """
        return call_params(
            self,
            kwargs,
            owner=type(self).__name__,
            stop=stop,
            fallback_documents=(metadata or {}).get(DOCUMENTS_METADATA_KEY),
            documents=LANGCHAIN_DOCUMENTS,
            ignored=_CORE_KWARGS,
        )

    async def _agenerate(
        self,
        inputs: list[Any],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> Any:
        """``_generate`` in a worker thread, with the run manager's synchronous twin: the
        engine decodes concurrent async callers together (both the LLM and the chat model)."""
        sync_manager = run_manager.get_sync() if run_manager else None
        return await call_in_thread(self._generate, inputs, stop, sync_manager, **kwargs)
