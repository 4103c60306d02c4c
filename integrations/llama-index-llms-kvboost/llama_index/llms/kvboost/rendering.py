"""How ``KVBoostLLM`` turns chat messages and completion prompts into the text the model reads.

By default chat messages go through the model's chat template (with the tools and the output
format of a call), and an unformatted completion prompt becomes the user turn of that
template after the system prompt. A custom ``messages_to_prompt`` / ``completion_to_prompt``
replaces either; a tokenizer without a chat template falls back to LlamaIndex's
``role: content`` rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.llms.kvboost.formatting import message_dicts

from kvboost_rag import InvalidInputError
from kvboost_rag.integration import CallFormat, render_chat


class Formatter:
    """A prompt-formatting callable whose repr does not recurse into the LLM that owns it."""

    def __init__(self, fn: Callable[..., str], description: str) -> None:
        self._fn = fn
        self._description = description

    def __call__(self, *args: Any) -> str:
        return self._fn(*args)

    def __repr__(self) -> str:
        return f"<KVBoostLLM {self._description}>"


class PromptRenderingMixin:
    """Prompt rendering of ``KVBoostLLM``.

    Needs ``_engine``, ``_has_chat_template``, ``_custom_messages_to_prompt``,
    ``_custom_completion_to_prompt``, ``system_prompt``, ``messages_to_prompt`` and
    ``completion_to_prompt``.
    """

    _engine: Any
    _has_chat_template: bool
    _custom_messages_to_prompt: bool
    _custom_completion_to_prompt: bool

    def _install_formatters(self, has_template: bool, custom_messages: bool, custom_completion: bool) -> None:
        """Like ``HuggingFaceLLM``: the public callables give the exact text sent to the model."""
        self._has_chat_template = has_template
        self._custom_messages_to_prompt = custom_messages
        self._custom_completion_to_prompt = custom_completion
        scheme = "chat template" if has_template else "role: content rendering"
        if not custom_messages:
            self.messages_to_prompt = Formatter(self._default_messages_to_prompt, scheme)
        if not custom_completion:
            self.completion_to_prompt = Formatter(self._default_completion_to_prompt, f"{scheme}, user turn")

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
            return self.messages_to_prompt(messages)  # type: ignore[attr-defined]
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
        if formatted:
            return prompt
        system_prompt = self.system_prompt  # type: ignore[attr-defined]
        if self._custom_completion_to_prompt:
            return self.completion_to_prompt(prompt)  # type: ignore[attr-defined]
        if self._has_chat_template or self._custom_messages_to_prompt:
            messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
            if system_prompt:
                messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=system_prompt))
            return self._chat_prompt(messages)
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
