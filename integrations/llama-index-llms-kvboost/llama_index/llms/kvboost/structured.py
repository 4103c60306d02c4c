"""Structured output of ``KVBoostLLM``: JSON decoded under the output class's schema.

``structured_predict`` and its async and streaming forms send the prompt through ``chat``
with a ``response_format`` of the output class's JSON schema, so decoding is constrained to
JSON valid for it; the streams yield partial copies (``FlexibleModel``) as the JSON decodes,
then the validated instance.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.program.utils import FlexibleModel, create_flexible_model

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate

M = TypeVar("M", bound=BaseModel)


def structured_kwargs(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat`` keywords that constrain the reply to JSON valid for ``output_cls``."""
    schema = output_cls.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": output_cls.__name__, "schema": schema}}
    return {**(llm_kwargs or {}), "response_format": response_format}


def parse_structured(output_cls: type[M], response: ChatResponse) -> M:
    """The ``output_cls`` instance a reply holds.

    Raises:
        ValueError: The JSON was cut by ``max_new_tokens``, or does not validate.
    """
    text = response.message.content or ""
    if (response.raw or {}).get("finish_reason") == "length":
        raise ValueError(
            f"the {output_cls.__name__} JSON was cut by max_new_tokens before it ended: raise max_new_tokens "
            f"(got {text!r})"
        )
    return output_cls.model_validate_json(text)


class StructuredStreamReader(Generic[M]):
    """Reads a streamed structured reply: partial copies while it decodes, then the instance."""

    def __init__(self, output_cls: type[M]) -> None:
        self._output_cls = output_cls
        self._flexible = create_flexible_model(output_cls)
        self._last: ChatResponse | None = None

    def read(self, response: ChatResponse) -> list[FlexibleModel]:
        """The partial copy after ``response`` (none before the first field, or for the final,
        empty delta)."""
        self._last = response
        if not response.delta:
            return []
        try:
            return [self._flexible.model_validate(parse_partial_json(response.message.content or ""))]
        except ValueError:  # not yet an object (json.JSONDecodeError and pydantic errors are ValueErrors)
            return []

    def finish(self) -> list[M]:
        """The validated instance of the whole reply (none for an empty stream)."""
        return [] if self._last is None else [parse_structured(self._output_cls, self._last)]


class StructuredOutputMixin:
    """``structured_predict`` and its async and streaming forms for ``KVBoostLLM``.

    Needs ``chat``, ``achat``, ``stream_chat``, ``astream_chat`` and ``_get_messages`` (LlamaIndex
    ``LLM``).
    """

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
        messages = self._get_messages(prompt, **prompt_args)  # type: ignore[attr-defined]
        response = self.chat(messages, **structured_kwargs(output_cls, llm_kwargs))  # type: ignore[attr-defined]
        return parse_structured(output_cls, response)

    async def astructured_predict(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> M:
        """Async :meth:`structured_predict`."""
        messages = self._get_messages(prompt, **prompt_args)  # type: ignore[attr-defined]
        response = await self.achat(messages, **structured_kwargs(output_cls, llm_kwargs))  # type: ignore[attr-defined]
        return parse_structured(output_cls, response)

    def _structured_stream_call(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[M | FlexibleModel, None, None]:
        """What ``stream_structured_predict`` yields: partial copies (``FlexibleModel``) as the
        JSON decodes under the output class's schema, then the validated instance."""
        messages = self._get_messages(prompt, **prompt_args)  # type: ignore[attr-defined]
        kwargs = structured_kwargs(output_cls, llm_kwargs)
        reader = StructuredStreamReader(output_cls)

        def gen() -> Generator[M | FlexibleModel, None, None]:
            for response in self.stream_chat(messages, **kwargs):  # type: ignore[attr-defined]
                yield from reader.read(response)
            yield from reader.finish()

        return gen()

    async def _structured_astream_call(
        self,
        output_cls: type[M],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[M | FlexibleModel, None]:
        """Async :meth:`_structured_stream_call`."""
        messages = self._get_messages(prompt, **prompt_args)  # type: ignore[attr-defined]
        responses = await self.astream_chat(messages, **structured_kwargs(output_cls, llm_kwargs))  # type: ignore[attr-defined]
        reader = StructuredStreamReader(output_cls)

        async def gen() -> AsyncGenerator[M | FlexibleModel, None]:
            async for response in responses:
                for partial in reader.read(response):
                    yield partial
            for instance in reader.finish():
                yield instance

        return gen()
