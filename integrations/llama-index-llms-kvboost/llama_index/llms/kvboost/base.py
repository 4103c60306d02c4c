"""``KVBoostLLM``: a LlamaIndex LLM on a local HuggingFace causal LM that reuses K/V.

It answers like ``HuggingFaceLLM`` but runs through a ``kvboost_rag.KVBoost`` engine: the
exact leading part of prompts (system turn up to the first document) is stored by the engine
after each answer and served by prefix hash; retrieved documents that were warmed
(``KVBoostPrewarmer``) are served by content hash wherever they land, system turn included.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.program.utils import FlexibleModel, create_flexible_model
from llama_index.llms.kvboost.formatting import message_dicts
from llama_index.llms.kvboost.retrieval import KVBoostRetrievalWarmer
from llama_index.llms.kvboost.tool_calling import (
    assistant_message,
    chat_with_tools_arguments,
    pop_call_format,
    tool_selections,
)

from kvboost_rag.async_stream import call_in_thread, iterate_in_thread
from kvboost_rag.background_warmer import BackgroundWarmer
from kvboost_rag.deprecation import warn_deprecated
from kvboost_rag.dropin import device_setting, generation_fields, model_settings
from kvboost_rag.errors import InvalidInputError
from kvboost_rag.engine_registry import resolve_engine
from kvboost_rag.react import react_call_format
from kvboost_rag.tool_calls import CallFormat, render_chat

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

    from kvboost_rag import GenerationResult, KVBoost, WarmResult

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

#: Generation keywords a call may override, and the engine keyword each maps to.
_CALL_KEYWORDS = {
    "max_new_tokens": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
    "reuse": "reuse",
}


class KVBoostLLM(CustomLLM, FunctionCallingLLM):
    """LlamaIndex LLM backed by the KVBoost reuse engine; a function-calling LLM.

    Build it from an engine, a local model folder, a loaded model and tokenizer, or nothing
    (the embedded SmolLM2-135M-Instruct). Prompts go through the model's chat template;
    the engine stores each prompt's exact leading part (the system turn up to the first
    document) after answering, so later prompts hit it by prefix hash; nothing is pinned per
    call (pin a fixed instruction block with :meth:`warm_prefix`). Each response's
    ``raw`` holds ``usage`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``) and
    the engine's timing and reuse figures (``ttft_ms``, ``kv_reuse_ratio``, ...).

    Function calling (``chat_with_tools``, ``FunctionAgent``, ``QueryEngineTool``) and
    structured output (``structured_predict``, ``as_structured_llm``) are valid by
    construction: decoding is constrained to a call of a given tool with schema-valid
    arguments, or to JSON valid for the output class (needs ``kvboost-rag[constrained]``).
    Tools reach the prompt through the chat template's ``tools=`` when it renders them, else
    as a "# Tools" section of the system message (``kvboost_rag.tool_calls``). One tool call
    per turn, or one or more with ``allow_parallel_tool_calls`` (``FunctionAgent``'s default).
    Calls and structured outputs close within ``max_new_tokens``: a budget below what the
    shortest valid output takes is an ``InvalidInputError`` naming that minimum.

    Examples:
        ```python
        from llama_index.core import Settings
        from llama_index.llms.kvboost import KVBoostLLM

        llm = KVBoostLLM(max_new_tokens=128)  # embedded default model
        Settings.llm = llm
        print(llm.complete("What does the 'with' statement do?").raw["ttft_ms"])
        ```
    """

    model_name: str = Field(description="Name of the model the engine runs.")
    model_path: str | None = Field(
        default=None,
        description="Local model folder the engine was loaded from; None for the embedded model or a given engine.",
    )
    context_window: int = Field(
        gt=0,
        description=(
            "Tokens prompt plus answer may take, as synthesizers budget them. Defaults to the "
            "model's maximum; set it lower to make synthesizers pack fewer tokens per call."
        ),
    )
    max_new_tokens: int = Field(
        default=256, gt=0, description="Most tokens generated per call (LlamaIndex num_output)."
    )
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 decodes greedily.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (used when temperature > 0).")
    repetition_penalty: float = Field(
        default=1.0,
        ge=1.0,
        description=(
            "Above 1, lowers the logits of tokens the answer already holds (prompt tokens are not "
            "penalized); about 1.2 keeps small models from looping inside structured outputs."
        ),
    )
    seed: int | None = Field(default=None, description="Seed for sampling; None leaves the generator as is.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end generation; the output is cut before them."
    )
    reuse: bool = Field(
        default=True,
        description="Reuse cached K/V. False runs a full prefill on every call (the baseline to compare with).",
    )
    react_grammar: bool = Field(
        default=True,
        description=(
            "Constrain replies to a ReAct prompt (the system message of LlamaIndex's ReActChatFormatter, "
            "as ReActAgent sends it) to one step of its format: a thought, then an action naming one of "
            "its tools with arguments valid for the tool's schema, or an answer."
        ),
    )
    react_tool_steps: int | None = Field(
        default=None,
        ge=0,
        description=(
            "With react_grammar: None lets the model act or answer at every ReAct step; n makes the "
            "first n steps after a question call a tool and the next one answer (as FunctionAgent's "
            "initial_tool_choice forces a first call). Small models left to choose tend to answer "
            "before searching, or to search again and again."
        ),
    )
    is_chat_model: bool = Field(
        default=True,
        description=(
            "Whether LlamaIndex sends chat messages (rendered with the model's chat template). "
            "Defaults to whether the tokenizer has a chat template."
        ),
    )

    _engine: Any = PrivateAttr()
    _model: Any = PrivateAttr()
    _tokenizer: Any = PrivateAttr()
    _has_chat_template: bool = PrivateAttr(default=False)
    _custom_messages_to_prompt: bool = PrivateAttr(default=False)
    _custom_completion_to_prompt: bool = PrivateAttr(default=False)
    _warmers: list = PrivateAttr(default_factory=list)

    def __init__(
        self,
        engine: KVBoost | None = None,
        model_path: str | None = None,
        model: Any | None = None,
        tokenizer: Any | None = None,
        engine_settings: dict[str, Any] | None = None,
        context_window: int | None = None,
        is_chat_model: bool | None = None,
        set_global_tokenizer: bool = True,
        messages_to_prompt: Callable[[Sequence[ChatMessage]], str] | None = None,
        completion_to_prompt: Callable[[str], str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Build the LLM and, unless given one, its engine.

        Args:
            engine: A ready ``KVBoost`` engine.
            model_path: Local HuggingFace model folder to load (instead of ``engine``). Engines
                built from a folder (or the default model) are shared per process by folder
                and ``engine_settings``, with the LangChain classes too.
            model: A loaded causal LM (with ``tokenizer``; instead of ``engine``).
            tokenizer: The fast tokenizer of ``model``.
            engine_settings: ``KVBoostSettings`` fields for an engine built here
                (``recompute_ratio``, ``kv_cache_bits``, ``disk_cache_dir``, ...).
            context_window: Token budget for synthesizers; at most the model's maximum.
            is_chat_model: Send chat messages; defaults to whether a chat template exists.
            set_global_tokenizer: Make the model's tokenizer LlamaIndex's global tokenizer so
                ``PromptHelper`` and chat-message estimates budget the model's real tokens
                (tiktoken's counts differ from this model's).
            messages_to_prompt: Custom chat rendering (default: the model's chat template).
            completion_to_prompt: Custom completion rendering (default: a user turn of the
                chat template, or the plain prompt when the model has none).
            **kwargs: Other fields (``max_new_tokens``, ``temperature``, ``system_prompt``,
                ``callback_manager``, ...), and what ``HuggingFaceLLM`` users type:
                ``model_name`` (the model to load, as ``model_path``), ``tokenizer_name``
                (the same model), ``generate_kwargs`` (``temperature``, ``top_p``,
                ``do_sample``, ``max_new_tokens``, ``seed``), ``device_map`` (``"auto"`` or
                one device), ``model_kwargs`` (``torch_dtype``), ``query_wrapper_prompt``
                (a ``{query_str}`` template for completion prompts). Arguments the engine
                cannot honour raise an error naming the alternative.

        Raises:
            ValueError: Conflicting sources, or ``context_window`` above the model's maximum.
            kvboost_rag.ModelNotFoundError: ``model_path`` holds no model.
        """
        model_path, engine_settings, completion_to_prompt = _huggingface_llm_arguments(
            kwargs, model_path, engine_settings, completion_to_prompt
        )
        if kwargs.pop("warm_shared_beginning", None) is not None:
            # Warming and pinning each system turn per call made memory grow with every query
            # (the context is in the system turn of several chat modes); the engine stores the
            # leading part of each prompt itself, evictable.
            warn_deprecated(
                "KVBoostLLM(warm_shared_beginning=...)",
                "nothing (the engine stores the leading part of each prompt itself; pin a fixed "
                "instruction block with llm.warm_prefix(text))",
            )
        resolved = resolve_engine(
            engine, model_path=model_path, model=model, tokenizer=tokenizer, settings=engine_settings
        )
        model_max = int(resolved.context_window)
        window = model_max if context_window is None else int(context_window)
        if window > model_max:
            raise ValueError(
                f"context_window={window} exceeds the model's maximum of {model_max} positions; "
                f"pass context_window<={model_max} or leave it unset"
            )
        has_template = bool(getattr(resolved.tokenizer, "chat_template", None))
        if is_chat_model is None:
            is_chat_model = has_template or messages_to_prompt is not None
        super().__init__(
            model_name=resolved.model_name,
            model_path=None if model_path is None else str(model_path),
            context_window=window,
            is_chat_model=is_chat_model,
            messages_to_prompt=messages_to_prompt,
            completion_to_prompt=completion_to_prompt,
            **kwargs,
        )
        if self.max_new_tokens >= self.context_window:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in "
                f"context_window={self.context_window}"
            )
        self._engine = resolved
        self._model = resolved.model
        self._tokenizer = resolved.tokenizer
        self._custom_messages_to_prompt = messages_to_prompt is not None
        self._custom_completion_to_prompt = completion_to_prompt is not None
        self._has_chat_template = has_template
        # Like HuggingFaceLLM: the public callables give the exact text sent to the model.
        scheme = "chat template" if has_template else "role: content rendering"
        if not self._custom_messages_to_prompt:
            self.messages_to_prompt = _Formatter(self._default_messages_to_prompt, scheme)
        if not self._custom_completion_to_prompt:
            self.completion_to_prompt = _Formatter(self._default_completion_to_prompt, f"{scheme}, user turn")
        if set_global_tokenizer:
            from llama_index.core import Settings

            Settings.tokenizer = self.model_tokenizer_fn
            logger.info("LlamaIndex global tokenizer set to the tokenizer of %s", self.model_name)

    @classmethod
    def class_name(cls) -> str:
        """Class name used in serialization."""
        return "KVBoostLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """Context window, num_output, model name and chat mode, as synthesizers use them."""
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            model_name=self.model_name,
            is_chat_model=self.is_chat_model,
            is_function_calling_model=True,
        )

    @property
    def engine(self) -> KVBoost:
        """The ``KVBoost`` engine (cache statistics, warming, direct generation)."""
        return self._engine

    @property
    def model_tokenizer_fn(self) -> Callable[[str], list[int]]:
        """``text -> token ids`` with the model's tokenizer (no special tokens added).

        For ``Settings.tokenizer``, ``PromptHelper(tokenizer=...)`` or
        ``TokenCountingHandler(tokenizer=...)``.
        """
        return partial(self._tokenizer.encode, add_special_tokens=False)

    def warm_prefix(self, text: str) -> WarmResult:
        """Warm a shared beginning (e.g. a fixed instruction block) for prefix-hash hits.

        Args:
            text: Text later prompts start with, exactly.

        Returns:
            The engine's ``WarmResult``.
        """
        return self._engine.warm(text)

    def enable_retrieval_warming(self, idle_seconds: float = 0.5) -> KVBoostRetrievalWarmer:
        """Register a retrieval-end handler that warms retrieved nodes not yet warm.

        Args:
            idle_seconds: Quiet time after the last answer before background warming starts.

        Returns:
            The attached handler (call ``detach()`` to stop it).
        """
        return KVBoostRetrievalWarmer(llm=self, idle_seconds=idle_seconds).attach()

    def attach_background_warmer(self, warmer: BackgroundWarmer) -> None:
        """Let ``warmer`` see this LLM's answers (claims and busy periods)."""
        if warmer not in self._warmers:
            self._warmers.append(warmer)

    def detach_background_warmer(self, warmer: BackgroundWarmer) -> None:
        """Stop reporting answers to ``warmer``."""
        if warmer in self._warmers:
            self._warmers.remove(warmer)

    # -- prompt rendering -------------------------------------------------------------------

    def _render_messages(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        output_format: CallFormat = CallFormat(),
    ) -> str:
        if self._custom_messages_to_prompt:
            if output_format.specs:
                raise InvalidInputError(
                    "tools cannot be shown through a custom messages_to_prompt; leave it unset to use "
                    "the chat template"
                )
            return self.messages_to_prompt(messages)  # type: ignore[misc]
        if not self._has_chat_template:
            if output_format.specs:
                raise InvalidInputError("tools need a chat template; this tokenizer has none")
            if output_format.instructions:
                messages = [ChatMessage(role=MessageRole.SYSTEM, content=output_format.instructions), *messages]
            return generic_messages_to_prompt(messages)
        return render_chat(self._engine, message_dicts(messages), output_format, add_generation_prompt)

    def _default_messages_to_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt ``chat`` sends for ``messages``: the model's chat template rendering."""
        return self._render_messages(messages, True)

    def _default_completion_to_prompt(self, prompt: str) -> str:
        """The prompt ``complete`` sends for an unformatted ``prompt``."""
        return self._completion_prompt(prompt, formatted=False)

    def _chat_prompt(self, messages: Sequence[ChatMessage], output_format: CallFormat = CallFormat()) -> str:
        if not messages:
            raise ValueError("chat needs at least one message")
        return self._render_messages(messages, output_format=output_format)

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if not formatted:
            if self._custom_completion_to_prompt:
                prompt = self.completion_to_prompt(prompt)  # type: ignore[misc]
            elif self._has_chat_template or self._custom_messages_to_prompt:
                messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
                if self.system_prompt:
                    messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt))
                return self._chat_prompt(messages)
            elif self.system_prompt:
                prompt = f"{self.system_prompt}\n\n{prompt}"
        return prompt

    # -- generation core --------------------------------------------------------------------

    def _call_params(self, overrides: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(overrides) - set(_CALL_KEYWORDS))
        if unknown:
            raise TypeError(f"unsupported generation keyword(s) {unknown}; accepted: {sorted(_CALL_KEYWORDS)}")
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "reuse": self.reuse,
        }
        for key, value in overrides.items():
            params[_CALL_KEYWORDS[key]] = value
        return params

    @contextmanager
    def _answer(self, prompt: str) -> Iterator[list[str]]:
        """Mark an answer in flight for background warmers; yields documents they hand over."""
        warmers = list(self._warmers)
        for warmer in warmers:
            warmer.answer_started()
        try:
            yield [text for warmer in warmers for text in warmer.claim(prompt)]
        finally:
            for warmer in warmers:
                warmer.answer_finished()

    def _raw(self, result: GenerationResult) -> dict[str, Any]:
        """The response's ``raw``: usage and the engine's figures (``ttft_ms``, ``kv_reuse_ratio``, ...)."""
        metrics = result.model_dump(exclude={"output_text", "token_ids", "first_token_logits", "step_logits"})
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens,
            "cached_tokens": result.cached_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }
        return {**metrics, "usage": usage, "model": self.model_name}

    def _generate(
        self, prompt: str, overrides: dict[str, Any], output_format: CallFormat = CallFormat()
    ) -> CompletionResponse:
        params = self._call_params(overrides)
        if output_format.constraint is not None:
            params["constraint"] = output_format.constraint
        with self._answer(prompt) as documents:
            result = self._engine.generate(prompt, documents=documents or None, **params)
        logger.debug(
            "generated %d tokens: ttft %.1f ms, reuse %.2f",
            result.generated_tokens,
            result.ttft_ms,
            result.kv_reuse_ratio,
        )
        return CompletionResponse(text=result.output_text, raw=self._raw(result))

    def _stream(
        self, prompt: str, overrides: dict[str, Any], output_format: CallFormat = CallFormat()
    ) -> CompletionResponseGen:
        params = self._call_params(overrides)
        if output_format.constraint is not None:
            params["constraint"] = output_format.constraint

        def gen() -> CompletionResponseGen:
            with self._answer(prompt) as documents:
                stream = self._engine.stream(prompt, documents=documents or None, **params)
                text = ""
                try:
                    for piece in stream:
                        text += piece
                        yield CompletionResponse(text=text, delta=piece)
                finally:
                    close = getattr(stream, "close", None)
                    if callable(close):
                        close()
                result = stream.result
            # The last response carries the usage and timing (known once the stream ended).
            yield CompletionResponse(text=result.output_text, delta="", raw=self._raw(result))

        return gen()

    # -- LlamaIndex LLM interface -----------------------------------------------------------

    def _complete_sync(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        return self._generate(self._completion_prompt(prompt, formatted), kwargs)

    def _output_format(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> CallFormat:
        """The tools and constraint of a chat call (taken out of ``kwargs``); with none given,
        the ReAct step constraint when the conversation is a ReAct prompt (``react_grammar``)."""
        output_format = pop_call_format(kwargs)
        react = self.react_grammar and output_format.constraint is None
        if react and messages and messages[0].role == MessageRole.SYSTEM:
            later = [(str(m.role.value), m.content or "") for m in messages[1:]]
            return react_call_format(messages[0].content, later, self.react_tool_steps) or output_format
        return output_format

    def _chat_sync(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        kwargs = dict(kwargs)
        output_format = self._output_format(messages, kwargs)
        return _as_chat(self._generate(self._chat_prompt(messages, output_format), kwargs, output_format), output_format)

    def _chat_stream(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        kwargs = dict(kwargs)
        output_format = self._output_format(messages, kwargs)
        responses = self._stream(self._chat_prompt(messages, output_format), kwargs, output_format)
        return _as_chat_stream(responses, output_format)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt``.

        Args:
            prompt: The prompt. Unless ``formatted``, it becomes the user turn of the chat
                template (after the system prompt), or ``completion_to_prompt`` renders it.
            formatted: ``prompt`` is final text; send it as is.
            **kwargs: Per-call ``max_new_tokens`` (or ``max_tokens``), ``temperature``,
                ``top_p``, ``repetition_penalty``, ``seed``, ``stop``, ``reuse``.

        Returns:
            The completion; ``raw`` holds usage, timing and reuse figures.
        """
        return self._complete_sync(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream the completion of ``prompt``; the last response (empty delta) carries ``raw``."""
        return self._stream(self._completion_prompt(prompt, formatted), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer a conversation rendered with the model's chat template.

        Args:
            messages: The conversation (tool results as ``tool`` messages with
                ``additional_kwargs["tool_call_id"]``).
            **kwargs: The generation keywords of :meth:`complete`, and ``tools``
                (OpenAI-style definitions), ``tool_choice`` (``"auto"``, ``"required"``, a
                tool name, ``"none"``), ``tool_required``, ``allow_parallel_tool_calls``,
                ``response_format``
                (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
                {"schema": ...}}``).
        """
        return self._chat_sync(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream the answer to a conversation; the last response carries ``raw`` (and, with
        tools, the tool calls: a call's text is not streamed as content)."""
        return self._chat_stream(messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Async ``complete``: rendering and generation run in a worker thread."""
        return await call_in_thread(self._complete_sync, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """Async ``stream_complete``: tokens are produced in a worker thread."""

        def make() -> CompletionResponseGen:
            return self._stream(self._completion_prompt(prompt, formatted), kwargs)

        return iterate_in_thread(make)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async ``chat``: rendering and generation run in a worker thread."""
        return await call_in_thread(self._chat_sync, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """Async ``stream_chat``: tokens are produced in a worker thread."""

        def make() -> ChatResponseGen:
            return self._chat_stream(messages, kwargs)

        return iterate_in_thread(make)

    # -- function calling and structured output ------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat`` arguments for ``chat_with_tools``: ``tool_required`` (or a ``tool_choice``
        keyword) constrains decoding to calls; otherwise the reply is text or calls. One call,
        or with ``allow_parallel_tool_calls`` one or more (each with its own id)."""
        return chat_with_tools_arguments(tools, user_msg, chat_history, tool_required, kwargs, allow_parallel_tool_calls)

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The tool calls of a ``chat_with_tools`` response.

        Raises:
            ValueError: No tool call and ``error_on_no_tool_call``.
        """
        return tool_selections(response.message, error_on_no_tool_call)

    def structured_predict(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> M:
        """An ``output_cls`` instance for ``prompt``, decoded as JSON valid for its schema.

        Args:
            output_cls: A pydantic model.
            prompt: The prompt template.
            llm_kwargs: Generation keywords (``max_new_tokens``, ...).
            **prompt_args: Template variables.

        Raises:
            ValueError: The output was cut by ``max_new_tokens`` before the JSON ended.

        ``stream_structured_predict`` / ``astream_structured_predict`` decode the same way and
        yield partial copies (``FlexibleModel``) before the validated instance.
        """
        messages = self._get_messages(prompt, **prompt_args)
        response = self.chat(messages, **self._structured_kwargs(output_cls, llm_kwargs))
        return _parse_structured(output_cls, response)

    async def astructured_predict(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> M:
        """Async :meth:`structured_predict`."""
        messages = self._get_messages(prompt, **prompt_args)
        response = await self.achat(messages, **self._structured_kwargs(output_cls, llm_kwargs))
        return _parse_structured(output_cls, response)

    def _structured_stream_call(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[M | FlexibleModel, None, None]:
        """What ``stream_structured_predict`` yields: partial copies (``FlexibleModel``) as the
        JSON decodes under the output class's schema, then the validated instance."""
        messages = self._get_messages(prompt, **prompt_args)
        kwargs = self._structured_kwargs(output_cls, llm_kwargs)
        flexible = create_flexible_model(output_cls)

        def gen() -> Generator[M | FlexibleModel, None, None]:
            last: ChatResponse | None = None
            for last in self.stream_chat(messages, **kwargs):
                partial = _partial_object(flexible, last)
                if partial is not None:
                    yield partial
            if last is not None:
                yield _parse_structured(output_cls, last)

        return gen()

    async def _structured_astream_call(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[M | FlexibleModel, None]:
        """Async :meth:`_structured_stream_call`."""
        messages = self._get_messages(prompt, **prompt_args)
        kwargs = self._structured_kwargs(output_cls, llm_kwargs)
        flexible = create_flexible_model(output_cls)
        responses = await self.astream_chat(messages, **kwargs)

        async def gen() -> AsyncGenerator[M | FlexibleModel, None]:
            last: ChatResponse | None = None
            async for last in responses:
                partial = _partial_object(flexible, last)
                if partial is not None:
                    yield partial
            if last is not None:
                yield _parse_structured(output_cls, last)

        return gen()

    @staticmethod
    def _structured_kwargs(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        schema = output_cls.model_json_schema()
        response_format = {"type": "json_schema", "json_schema": {"name": output_cls.__name__, "schema": schema}}
        return {**(llm_kwargs or {}), "response_format": response_format}


def _huggingface_llm_arguments(
    kwargs: dict[str, Any],
    model_path: str | None,
    engine_settings: dict[str, Any] | None,
    completion_to_prompt: Callable[[str], str] | None,
) -> tuple[str | None, dict[str, Any] | None, Callable[[str], str] | None]:
    """Map (and remove from ``kwargs``) the arguments ``HuggingFaceLLM`` users type.

    Returns:
        The model path, engine settings and completion formatter to use.

    Raises:
        kvboost_rag.InvalidInputError: An argument the engine cannot honour (the message
            names the alternative), or two arguments that disagree.
    """
    name = kwargs.pop("model_name", None)
    if name is not None:
        if model_path is not None and str(model_path) != str(name):
            raise InvalidInputError(f"model_name={name!r} and model_path={model_path!r} disagree; pass one")
        model_path = str(name)
    tokenizer_name = kwargs.pop("tokenizer_name", None)
    if tokenizer_name is not None and str(tokenizer_name) != str(model_path):
        raise InvalidInputError(
            f"tokenizer_name={tokenizer_name!r} differs from the model {model_path!r}: kvboost reads prompts with "
            "the model's own tokenizer; load both yourself and pass model= and tokenizer="
        )
    if kwargs.pop("tokenizer_kwargs", None):
        raise InvalidInputError(
            "tokenizer_kwargs are not supported; load the tokenizer yourself "
            "(AutoTokenizer.from_pretrained(..., **kwargs)) and pass model= and tokenizer="
        )
    stopping_ids = kwargs.pop("stopping_ids", None)
    if stopping_ids:
        raise InvalidInputError(
            f"stopping_ids={stopping_ids!r} is not supported; pass stop=[...] strings (the model's own EOS "
            "tokens always end generation)"
        )
    settings = dict(engine_settings or {})
    settings.update(model_settings(kwargs.pop("model_kwargs", None)))
    device = device_setting(None, kwargs.pop("device_map", None))
    if device is not None:
        settings["device"] = device
    for field, value in generation_fields(kwargs.pop("generate_kwargs", None), "generate_kwargs").items():
        if field in kwargs and kwargs[field] != value:
            raise InvalidInputError(f"generate_kwargs[{field!r}]={value!r} and {field}={kwargs[field]!r} disagree; pass one")
        kwargs[field] = value
    wrapper = kwargs.pop("query_wrapper_prompt", None)
    if wrapper is not None:
        if completion_to_prompt is not None:
            raise InvalidInputError("pass query_wrapper_prompt or completion_to_prompt, not both")
        template = str(getattr(wrapper, "template", wrapper))
        if "{query_str}" not in template:
            raise InvalidInputError(f"query_wrapper_prompt must contain {{query_str}}, got {template!r}")
        completion_to_prompt = partial(_wrap_query, template)
    return model_path, settings or None, completion_to_prompt


def _wrap_query(template: str, query: str) -> str:
    return template.replace("{query_str}", query)


class _Formatter:
    """A prompt-formatting callable whose repr does not recurse into the LLM that owns it."""

    def __init__(self, fn: Callable[..., str], description: str) -> None:
        self._fn = fn
        self._description = description

    def __call__(self, *args: Any) -> str:
        return self._fn(*args)

    def __repr__(self) -> str:
        return f"<KVBoostLLM {self._description}>"


def _as_chat(response: CompletionResponse, output_format: CallFormat = CallFormat()) -> ChatResponse:
    finish = (response.raw or {}).get("finish_reason", "")
    return ChatResponse(
        message=assistant_message(response.text, finish, output_format),
        delta=response.delta,
        raw=response.raw,
    )


def _as_chat_stream(responses: CompletionResponseGen, output_format: CallFormat = CallFormat()) -> ChatResponseGen:
    """Chat responses of a stream. With tools, an output starting with ``<`` (a call: plain
    text under a tool constraint never starts so) is not shown as content while it streams;
    the last response carries the parsed calls."""
    holding = False
    for response in responses:
        if output_format.parses_tool_calls and (holding or response.text.startswith("<")):
            holding = True
            if response.raw is None:
                continue
        yield _as_chat(response, output_format)


def _partial_object(flexible: type[FlexibleModel], response: ChatResponse) -> FlexibleModel | None:
    """The fields decoded so far (``None`` before the first or for a final, empty delta)."""
    if not response.delta:
        return None
    try:
        return flexible.model_validate(parse_partial_json(response.message.content or ""))
    except ValueError:  # not yet an object (json.JSONDecodeError and pydantic errors are ValueErrors)
        return None


def _parse_structured(output_cls: type[M], response: ChatResponse) -> M:
    text = response.message.content or ""
    if (response.raw or {}).get("finish_reason") == "length":
        raise ValueError(
            f"the {output_cls.__name__} JSON was cut by max_new_tokens before it ended: raise max_new_tokens "
            f"(got {text!r})"
        )
    return output_cls.model_validate_json(text)




