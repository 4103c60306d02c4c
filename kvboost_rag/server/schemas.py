"""Request bodies of the OpenAI API, as pydantic models (responses: :mod:`.responses`).

Fields follow the OpenAI API reference; values are checked strictly (``"12"`` is no
``max_tokens``, ``"yes"`` no ``stream``). Fields other servers take as extensions (vLLM's
``repetition_penalty``) and this server's own (``documents``, ``reuse``) sit beside them;
fields this server does not know are ignored, as vLLM ignores them, and listed in the log.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

#: Message roles; ``developer`` reads as ``system`` and ``function`` (the older name) as ``tool``.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


def _integral(value: Any) -> Any:
    """A float with no fraction as the integer it is (JSON and JSON Schema do not tell ``2.0``
    from ``2``); anything else as given, for the strict check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field: an int, or a float with no fraction (``2.0``); never text (``"2"``).
Integer = Annotated[int, BeforeValidator(_integral)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        """Fields of the request this server does not know (ignored)."""
        return sorted(self.model_extra or {})


class ContentPart(_Body):
    """One part of a message's content.

    Attributes:
        type: ``"text"`` (other kinds, such as images, are refused: the models are text only).
        text: The part's text.
        cache_control: Any object (``{"type": "ephemeral"}``, as Anthropic and LangChain users
            write it): the part's text is one of the prompt's documents, cut on its
            boundaries and stored, as if named in ``documents``.
    """

    type: str
    text: str | None = None
    cache_control: dict[str, Any] | None = None


class FunctionCall(_Body):
    """The function of an assistant's tool call: its name and JSON-encoded arguments."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    """One tool call of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One message of a conversation."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ToolFunction(_Body):
    """The function of a tool definition: a name, and its arguments' JSON object schema."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Body):
    """One tool of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(_Body):
    """The function a ``tool_choice`` object names."""

    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` naming one tool: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: the schema the output follows, and its name."""

    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")


class ResponseFormat(_Body):
    """``response_format``: ``text``, ``json_object``, or ``json_schema`` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _shaped(model: type[BaseModel]) -> Callable[[Any], Any]:
    """A validator checking a value against ``model`` and keeping it as given (the handlers
    read these fields as plain JSON)."""

    def check(value: Any) -> Any:
        model.model_validate(value)
        return value

    return check


#: A tool definition, checked for its shape and kept as JSON.
ToolJSON = Annotated[dict[str, Any], AfterValidator(_shaped(ToolDefinition))]
#: A ``tool_choice`` object, checked for its shape and kept as JSON.
ToolChoiceJSON = Annotated[dict[str, Any], AfterValidator(_shaped(NamedToolChoice))]
#: A ``response_format``, checked for its shape and kept as JSON.
ResponseFormatJSON = Annotated[dict[str, Any], AfterValidator(_shaped(ResponseFormat))]


class StreamOptions(_Body):
    """``include_usage``: a last chunk (empty ``choices``) carries the usage."""

    include_usage: bool = False


class GenerationFields(_Body):
    """Fields both endpoints take."""

    model: str
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: Integer = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Integer | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormatJSON | None = None
    # Extensions (vLLM's names where vLLM has them).
    repetition_penalty: float | None = None
    reuse: bool | None = None
    documents: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)
    tools: list[ToolJSON] | None = None
    tool_choice: str | ToolChoiceJSON | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Integer | None = None


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: Integer | None = None
    logprobs: Integer | None = None


class WarmDocument(_Body):
    """A document to warm, with an id for the report."""

    id: str | None = None
    text: str


class WarmRequest(_Body):
    """``POST /v1/documents`` as JSON: the documents, texts or ``{"id", "text"}`` objects."""

    documents: list[str | WarmDocument]
