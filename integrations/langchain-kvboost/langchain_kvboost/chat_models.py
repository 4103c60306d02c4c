"""``ChatKVBoost``: a chat model on a local HuggingFace model with K/V reuse."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from kvboost_rag.integration import (
    CallFormat,
    iterate_in_thread,
    normalize_tool_choice,
    render_chat,
    tool_specs,
)
from kvboost_rag.integration.dropin import GENERATION_FIELDS, generation_fields
from kvboost_rag.integration.engine_registry import resolve_engine
from kvboost_rag.integration.tool_arguments import pop_call_format
from kvboost_rag.integration.tool_stream import ToolCallHoldBack
from kvboost_rag.integration.usage import result_figures, usage
from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import (
    BaseChatModel,
    LangSmithParams,
    LanguageModelInput,
)
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, model_validator

from langchain_kvboost._common import KVBoostParams
from langchain_kvboost.tool_calling import (
    ai_message,
    message_dict,
    structured_output,
    tool_call_chunks,
)

logger = logging.getLogger(__name__)

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}

#: Content block types that carry media this text-only integration cannot read.
_MEDIA_BLOCKS = frozenset(
    {"image", "image_url", "file", "audio", "input_audio", "video", "document", "text-plain"}
)


def _message_text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif block.get("type") in _MEDIA_BLOCKS:
            raise ValueError(
                f"ChatKVBoost reads text only; got a {block.get('type')!r} content block in a "
                f"{message.type} message."
            )
        # Other blocks (reasoning, tool-call echoes) carry no prompt text for this model.
    return "".join(parts)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as ``{"role", "content"}`` dicts for the model's chat template
    (assistant tool calls and tool results in the OpenAI layout: ``tool_calls``,
    ``tool_call_id``).

    Raises:
        ValueError: A message type with no chat role, or non-text content.
    """
    dicts: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        else:
            role = _ROLES.get(message.type, "")
        if not role:
            raise ValueError(f"ChatKVBoost cannot place a {message.type!r} message in a chat template.")
        dicts.append(message_dict(message, role, _message_text(message)))
    return dicts


def _fields_of_llm(llm: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """``ChatKVBoost`` fields taken from ``llm=`` (a ``KVBoostLLM`` or a ``HuggingFacePipeline``).

    Raises:
        ValueError: ``llm`` is neither, or ``engine``/``model`` are given too.
    """
    from langchain_kvboost.llms import KVBoostLLM

    clash = [name for name in ("engine", "model") if given.get(name) is not None]
    if clash:
        raise ValueError(f"Pass llm= or {clash[0]}=, not both: the model comes from one source.")
    if isinstance(llm, KVBoostLLM):
        fields = {name: getattr(llm, name) for name in (*GENERATION_FIELDS, "stop", "reuse")}
        return {**fields, "engine": llm.engine}
    pipeline = getattr(llm, "pipeline", None)
    if pipeline is not None and getattr(pipeline, "model", None) is not None and getattr(pipeline, "tokenizer", None) is not None:
        # A HuggingFacePipeline: its loaded model and tokenizer, and its pipeline_kwargs.
        engine = resolve_engine(model=pipeline.model, tokenizer=pipeline.tokenizer, settings=given.get("engine_settings"))
        generation = generation_fields(getattr(llm, "pipeline_kwargs", None), "llm.pipeline_kwargs")
        return {**generation, "engine": engine, "engine_settings": None}
    raise ValueError(
        f"ChatKVBoost(llm=...) takes a langchain_kvboost.KVBoostLLM or a HuggingFacePipeline, got "
        f"{type(llm).__name__}; or pass model='path/to/hf/folder' or engine=..."
    )


def _usage_metadata(result: Any) -> UsageMetadata:
    """LangChain's ``usage_metadata`` of one result (the core usage dict, renamed)."""
    counts = usage(result)
    return UsageMetadata(
        input_tokens=counts["prompt_tokens"],
        output_tokens=counts["completion_tokens"],
        total_tokens=counts["total_tokens"],
        input_token_details=InputTokenDetails(cache_read=counts["cached_tokens"]),
    )


class ChatKVBoost(KVBoostParams, BaseChatModel):
    """Chat model on a local HuggingFace causal LM that reuses cached K/V across calls.

    Messages are rendered with the model's own chat template and sent to the engine as one
    prompt. The engine decides what stays cached: after each answer it stores the exact
    leading part of the prompt up to the first document (so the next conversation with the
    same system message hits it by prefix hash), and documents that were prewarmed
    (``KVBoostPrewarmer``) or passed as ``documents`` are served from cache wherever they land,
    in any order, system message included. Nothing is pinned per call: what stays cached is
    evictable; pin a fixed system prompt yourself with ``chat.engine.warm(text)``.

    A drop-in replacement for ``ChatHuggingFace`` (text only, no images) that also makes tool
    calls (:meth:`bind_tools`) and structured output (:meth:`with_structured_output`) valid by
    construction: decoding is constrained to a call of a bound tool with schema-valid
    arguments, or to JSON valid for the schema, closed within ``max_new_tokens`` (needs
    ``kvboost-rag[constrained]``). Tools
    reach the prompt through the chat template's ``tools=`` when the template renders them,
    else as a "# Tools" section of the system message (see ``kvboost_rag.decode.tool_calls``); the
    tool text is part of the prompt's cached prefix like any system text.

    Instantiate:
        .. code-block:: python

            from langchain_kvboost import ChatKVBoost

            chat = ChatKVBoost(max_new_tokens=128)           # embedded SmolLM2-135M-Instruct
            chat = ChatKVBoost(model="path/to/hf/folder", temperature=0.7, seed=1)
            chat = ChatKVBoost(llm=KVBoostLLM.from_model_id(model_id="path/to/hf/folder"))
            chat = ChatKVBoost(llm=hugging_face_pipeline)    # reuses its model and pipeline_kwargs

    Invoke:
        .. code-block:: python

            msg = chat.invoke([("system", "You answer briefly."), ("human", "What is a tuple?")])
            msg.usage_metadata["input_token_details"]["cache_read"]   # tokens served from cache
            msg.response_metadata["ttft_ms"]
    """

    # The LangChain base classes ignore unknown fields; a misspelt parameter should fail.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _from_llm(cls, values: Any) -> Any:
        # ChatHuggingFace(llm=HuggingFacePipeline(...)) -> ChatKVBoost(llm=...): the engine and
        # generation settings come from the LLM; fields given here win.
        if not isinstance(values, dict) or "llm" not in values:
            return values
        values = dict(values)
        fields = _fields_of_llm(values.pop("llm"), values)
        if "engine_settings" in fields:  # consumed building the engine around the pipeline's model
            values.pop("engine_settings", None)
        return {**fields, **values}

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    @property
    def _identifying_params(self) -> Mapping[str, Any]:
        return self._params_dict()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._langsmith_params("chat", stop, **kwargs)

    def render_prompt(self, messages: Sequence[BaseMessage], tools: Sequence[Any] | None = None) -> str:
        """The prompt string the model reads for ``messages`` (chat template applied).

        Args:
            messages: The conversation.
            tools: Tools shown to the model (anything ``bind_tools`` takes).

        Returns:
            The rendering with the generation prompt for the assistant's turn appended.
        """
        specs = tuple(tool_specs([convert_to_openai_tool(t) for t in tools or []]))
        return self._render(to_chat_dicts(messages), CallFormat(specs))

    def _render(self, dicts: list[dict[str, Any]], call_format: CallFormat = CallFormat()) -> str:
        return render_chat(self.engine, dicts, call_format)

    def _prepare(
        self,
        messages: Sequence[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[str, dict[str, Any], CallFormat]:
        """The prompt, the engine parameters and the tool/format setting of one call."""
        kwargs = dict(kwargs)
        call_format = pop_call_format(kwargs, convert_to_openai_tool)
        params = self._call_params(stop, kwargs, run_manager.metadata if run_manager else None)
        if call_format.constraint is not None:
            params["constraint"] = call_format.constraint
        return self._render(to_chat_dicts(messages), call_format), params, call_format

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """A model that may call ``tools``; its replies carry ``AIMessage.tool_calls``.

        Args:
            tools: Tools as LangChain tools, functions, pydantic models, TypedDicts or
                OpenAI-style dicts.
            tool_choice: ``"auto"`` (default: a plain-text answer or one call; a call's
                ``tool_required=True`` makes the default ``"required"``),
                ``"any"``/``"required"``/``True`` (one call of any tool), a tool's name (one
                call of that tool), or ``"none"`` (plain text; the tools stay in the prompt).
                Decoding is constrained accordingly, so every call names a bound tool and its
                arguments are valid for the tool's schema, and the calls close within
                ``max_new_tokens`` (a budget below the shortest call is an
                ``InvalidInputError`` naming the minimum).
            parallel_tool_calls: ``True`` lets one reply hold one or more calls (each with
                its own id) where one call is allowed; else one call per turn.
            **kwargs: Other per-call parameters to bind.

        Raises:
            InvalidInputError: A ``tool_choice`` that names no bound tool, or a malformed tool.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [s.name for s in tool_specs(formatted)]
        if tool_choice is not None:  # unset: "auto", unless a call passes tool_required=True
            kwargs["tool_choice"] = normalize_tool_choice(tool_choice, names)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A model whose output is parsed into ``schema``; valid by construction.

        Args:
            schema: A pydantic model (output: an instance), a TypedDict or a JSON schema
                (output: a dict). Optional with ``method="json_mode"``.
            method: ``"json_schema"``: decoding constrained to JSON valid for the schema;
                ``"function_calling"``: a forced call of a tool whose arguments are the
                schema; ``"json_mode"``: a JSON object, described by your prompt (with a schema,
                decoding also follows it, but only "a JSON object" is said in the prompt).
                Objects without ``additionalProperties`` are closed before compiling.
            include_raw: Return ``{"raw", "parsed", "parsing_error"}`` instead of the parsed
                value (parsing errors are then caught).
            strict: Accepted for API compatibility: the output always follows the schema.
            **kwargs: Not accepted (a ``ValueError`` names them).

        Raises:
            InvalidInputError: An unknown method, or no schema where one is needed.
        """
        if kwargs:
            raise ValueError(f"with_structured_output got unsupported arguments {sorted(kwargs)}")
        return structured_output(self, schema, method, include_raw, strict)

    def _result_message_fields(self, result: Any) -> tuple[dict[str, Any], UsageMetadata, dict[str, Any]]:
        info = result_figures(result)
        response_metadata = {"model_name": self.model_name, "finish_reason": info["finish_reason"]}
        return info, _usage_metadata(result), response_metadata

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt, params, call_format = self._prepare(messages, stop, run_manager, kwargs)
        result = self.engine.generate(prompt, **params)
        info, usage, response_metadata = self._result_message_fields(result)
        message = ai_message(
            result.output_text,
            result.finish_reason,
            call_format,
            usage_metadata=usage,
            response_metadata=response_metadata,
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info=info)],
            llm_output={"model_name": self.model_name},
        )

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[BaseMessage]:
        """Answer several inputs at once: every input runs at the same time (unless
        ``max_concurrency`` is set), so the engine decodes them together, one forward pass
        per step for all of them (``max_batch_size`` of the engine's settings caps it).

        Callbacks, tracing and ``return_exceptions`` work as in ``invoke``; each answer's
        usage and reuse figures are its own.
        """
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        if all(c.get("max_concurrency") is None for c in configs):
            configs = [{**c, "max_concurrency": len(inputs)} for c in configs]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    def _start_stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> tuple[Any, CallFormat]:
        prompt, params, call_format = self._prepare(messages, stop, run_manager, kwargs)
        return self.engine.stream(prompt, **params), call_format

    @staticmethod
    def _chunks(stream: Any, call_format: CallFormat) -> Iterator[ChatGenerationChunk]:
        """The stream's text pieces as chunks; a tool call is held back and sent whole as
        tool-call chunks once the stream has ended (see ``kvboost_rag.integration.tool_stream``)."""
        hold = ToolCallHoldBack(call_format)
        for piece in stream:
            shown = hold.feed(piece)
            if shown is not None:
                yield ChatGenerationChunk(message=AIMessageChunk(content=shown))
        parsed = hold.finish(stream.result.finish_reason)
        if parsed is not None:
            yield ChatGenerationChunk(
                message=AIMessageChunk(content=parsed.content, tool_call_chunks=tool_call_chunks(parsed))
            )

    def _last_chunk(self, stream: Any) -> ChatGenerationChunk:
        info, usage, response_metadata = self._result_message_fields(stream.result)
        message = AIMessageChunk(
            content="",
            usage_metadata=usage,
            response_metadata=response_metadata,
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info=info)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # LangChain core reports each yielded chunk to the callbacks itself.
        stream, call_format = self._start_stream(messages, stop, run_manager, kwargs)
        yield from self._chunks(stream, call_format)
        yield self._last_chunk(stream)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        started: list[Any] = []

        def start() -> Iterator[ChatGenerationChunk]:
            # Rendering and starting the stream block: keep them off the loop.
            started.extend(self._start_stream(messages, stop, run_manager, kwargs))
            return self._chunks(started[0], started[1])

        async for chunk in iterate_in_thread(start):
            yield chunk
        yield self._last_chunk(started[0])

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the model's own tokenizer (no special tokens)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(self.engine.token_ids(text))

    def get_num_tokens(self, text: str) -> int:
        """Number of model tokens in ``text``."""
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(
        self,
        messages: list[BaseMessage],
        tools: Sequence[Any] | None = None,
    ) -> int:
        """Number of tokens the model reads for ``messages``, chat template and ``tools``
        included."""
        return self.get_num_tokens(self.render_prompt(messages, tools))
