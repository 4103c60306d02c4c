"""Rendering chat messages with the model's chat template."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvboost_rag.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_rendering", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


class ChatTemplate:
    """The tokenizer's chat template.

    Args:
        tokenizer: The model's tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._renders_tools: bool | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render chat messages (see :meth:`kvboost_rag.KVBoost.apply_chat_template`).

        Raises:
            UnsupportedModelError: The tokenizer has no chat template.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise UnsupportedModelError("this tokenizer has no chat template; pass a plain prompt instead")
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    @property
    def renders_tools(self) -> bool:
        """Whether the template shows tools passed as ``tools=`` (checked once, by rendering
        one message with a probe tool)."""
        if self._renders_tools is None:
            if not getattr(self.tokenizer, "chat_template", None):
                self._renders_tools = False
            else:
                try:
                    rendered = self.render([{"role": "user", "content": "?"}], tools=[_PROBE_TOOL])
                except Exception:  # noqa: BLE001 - a template that fails on tools= does not render them
                    logger.debug("the chat template fails when given tools=", exc_info=True)
                    self._renders_tools = False
                else:
                    self._renders_tools = "probe_tool_rendering" in rendered
        return self._renders_tools
