"""``KVBoostLLM``: a LlamaIndex LLM on a local HuggingFace causal LM that reuses K/V.

It answers like ``HuggingFaceLLM`` but runs through a ``kvboost_rag.KVBoost`` engine: the
exact leading part of prompts (system turn up to the first document) is stored by the engine
after each answer and served by prefix hash; retrieved documents that were warmed
(``KVBoostPrewarmer``) or passed as ``documents`` are served by content hash wherever they
land, system turn included.

The class is assembled from parts: ``huggingface`` maps ``HuggingFaceLLM`` arguments,
``rendering`` turns messages into prompts, ``structured`` decodes structured output, and the
per-call parameters, usage and tool-call stream hold-back are those of
:mod:`kvboost_rag.integration`, shared with the LangChain integration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

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
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.llms.kvboost.formatting import NODE_DOCUMENTS
from llama_index.llms.kvboost.huggingface import huggingface_llm_arguments
from llama_index.llms.kvboost.rendering import PromptRenderingMixin
from llama_index.llms.kvboost.retrieval import KVBoostRetrievalWarmer
from llama_index.llms.kvboost.structured import StructuredOutputMixin
from llama_index.llms.kvboost.tool_calling import (
    assistant_message,
    chat_with_tools_arguments,
    openai_tool,
    tool_selections,
)

from kvboost_rag.integration import (
    BackgroundWarmer,
    CallFormat,
    call_in_thread,
    iterate_in_thread,
    react_call_format,
)
from kvboost_rag.integration.engine_registry import resolve_engine
from kvboost_rag.integration.params import call_params, resolve_aliases
from kvboost_rag.integration.tool_arguments import pop_call_format
from kvboost_rag.integration.tool_stream import ToolCallHoldBack
from kvboost_rag.integration.usage import result_figures, usage

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

    from kvboost_rag import GenerationResult, KVBoost, WarmResult

logger = logging.getLogger(__name__)


class KVBoostLLM(PromptRenderingMixin, StructuredOutputMixin, CustomLLM, FunctionCallingLLM):
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
    as a "# Tools" section of the system message (``kvboost_rag.decode.tool_calls``). One tool call
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

    # LlamaIndex's base classes ignore unknown fields; a misspelt parameter should fail.
    model_config = ConfigDict(extra="forbid")

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
        """Build the LLM and, unless given one, its engine (from exactly one source).

        Args:
            engine: A ready ``KVBoost`` engine.
            model_path: Local HuggingFace model folder; engines built from a folder (or the
                default model) are shared per process by folder and ``engine_settings``.
            model: A loaded causal LM, with ``tokenizer`` (its fast tokenizer).
            tokenizer: The fast tokenizer of ``model``.
            engine_settings: ``KVBoostSettings`` fields for an engine built here.
            context_window: Token budget for synthesizers; at most the model's maximum.
            is_chat_model: Send chat messages; defaults to whether a chat template exists.
            set_global_tokenizer: Make the model's tokenizer LlamaIndex's global tokenizer.
            messages_to_prompt: Custom chat rendering (default: the model's chat template).
            completion_to_prompt: Custom completion rendering (default: a user turn of the
                chat template, or the plain prompt when the model has none).
            **kwargs: Other fields (``max_new_tokens`` or ``max_tokens``, ``temperature``,
                ``system_prompt``, ...) and the arguments ``HuggingFaceLLM`` users type (see
                ``llama_index.llms.kvboost.huggingface``).

        Raises:
            ValueError: Conflicting sources, ``context_window`` above the model's maximum,
                ``max_new_tokens`` leaving no room for a prompt, or an unknown keyword (a
                pydantic ``ValidationError`` naming it).
            kvboost_rag.ModelNotFoundError: ``model_path`` holds no model.
        """
        kwargs = resolve_aliases(kwargs)
        sources = huggingface_llm_arguments(kwargs, model_path, engine_settings, completion_to_prompt)
        resolved = resolve_engine(
            engine, model_path=sources.model_path, model=model, tokenizer=tokenizer, settings=sources.engine_settings
        )
        has_template = bool(getattr(resolved.tokenizer, "chat_template", None))
        super().__init__(
            model_name=resolved.model_name,
            model_path=sources.model_path,
            context_window=_context_window(resolved, context_window),
            is_chat_model=(has_template or messages_to_prompt is not None) if is_chat_model is None else is_chat_model,
            messages_to_prompt=messages_to_prompt,
            completion_to_prompt=sources.completion_to_prompt,
            **kwargs,
        )
        if self.max_new_tokens >= self.context_window:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in context_window={self.context_window}"
            )
        self._engine = resolved
        self._install_formatters(has_template, messages_to_prompt is not None, sources.completion_to_prompt is not None)
        if set_global_tokenizer:
            self._set_global_tokenizer()

    def _set_global_tokenizer(self) -> None:
        """Make the model's tokenizer LlamaIndex's global one, so ``PromptHelper`` and chat
        estimates budget the model's real tokens (tiktoken's counts differ)."""
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
        return partial(self._engine.tokenizer.encode, add_special_tokens=False)

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

    # -- generation core --------------------------------------------------------------------

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

    def _params(self, overrides: dict[str, Any], output_format: CallFormat) -> dict[str, Any]:
        """The engine keywords of one call: its parameters and its output constraint."""
        params = call_params(self, overrides, owner="KVBoostLLM", documents=NODE_DOCUMENTS)
        if output_format.constraint is not None:
            params["constraint"] = output_format.constraint
        return params

    @staticmethod
    def _with_claimed(params: dict[str, Any], claimed: list[str]) -> dict[str, Any]:
        """``params`` whose documents include those the background warmers handed over."""
        if not claimed:
            return params
        return {**params, "documents": list(dict.fromkeys([*(params["documents"] or []), *claimed]))}

    def _raw(self, result: GenerationResult) -> dict[str, Any]:
        """The response's ``raw``: usage and the engine's figures (``ttft_ms``, ``kv_reuse_ratio``, ...)."""
        return {**result_figures(result), "usage": usage(result), "model": self.model_name}

    def _generate(
        self, prompt: str, overrides: dict[str, Any], output_format: CallFormat = CallFormat()
    ) -> CompletionResponse:
        params = self._params(overrides, output_format)
        with self._answer(prompt) as claimed:
            result = self._engine.generate(prompt, **self._with_claimed(params, claimed))
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
        params = self._params(overrides, output_format)  # a bad keyword fails the call itself

        def gen() -> CompletionResponseGen:
            with self._answer(prompt) as claimed:
                stream = self._engine.stream(prompt, **self._with_claimed(params, claimed))
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
        output_format = pop_call_format(kwargs, openai_tool)
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
            **kwargs: Per-call parameters (``kvboost_rag.integration.params.CALL_PARAMETERS``):
                ``max_new_tokens`` (or ``max_tokens``), ``temperature``, ``top_p``,
                ``repetition_penalty``, ``seed``, ``stop``, ``reuse``, and ``documents``
                (strings or nodes the prompt holds: cut on their boundaries and stored for
                the next prompt).

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
            **kwargs: The per-call parameters of :meth:`complete`, and the tool keywords
                (``kvboost_rag.integration.tool_arguments.TOOL_PARAMETERS``): ``tools``
                (``BaseTool`` objects or OpenAI-style definitions), ``tool_choice``
                (``"auto"``, ``"required"``, a tool name, ``"none"``), ``tool_required``,
                ``allow_parallel_tool_calls`` (or ``parallel_tool_calls``),
                ``response_format`` (``{"type": "json_object"}`` or ``{"type":
                "json_schema", "json_schema": {"schema": ...}}``).
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

    # -- function calling --------------------------------------------------------------------

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


def _context_window(engine: KVBoost, requested: int | None) -> int:
    """The synthesizers' token budget: ``requested``, or the model's maximum.

    Raises:
        ValueError: ``requested`` above the model's maximum.
    """
    model_max = int(engine.context_window)
    window = model_max if requested is None else int(requested)
    if window > model_max:
        raise ValueError(
            f"context_window={window} exceeds the model's maximum of {model_max} positions; "
            f"pass context_window<={model_max} or leave it unset"
        )
    return window


def _as_chat(response: CompletionResponse, output_format: CallFormat = CallFormat()) -> ChatResponse:
    finish = (response.raw or {}).get("finish_reason", "")
    return ChatResponse(
        message=assistant_message(response.text, finish, output_format),
        delta=response.delta,
        raw=response.raw,
    )


def _as_chat_stream(responses: CompletionResponseGen, output_format: CallFormat = CallFormat()) -> ChatResponseGen:
    """Chat responses of a stream. A tool call is held back while it streams (see
    ``kvboost_rag.integration.tool_stream``); the last response carries the parsed calls."""
    hold = ToolCallHoldBack(output_format)
    for response in responses:
        if response.raw is not None:  # the last response: the whole reply, calls parsed
            yield _as_chat(response, output_format)
        elif hold.feed(response.delta or "") is not None:
            message = ChatMessage(role=MessageRole.ASSISTANT, content=hold.shown_text)
            yield ChatResponse(message=message, delta=response.delta)
