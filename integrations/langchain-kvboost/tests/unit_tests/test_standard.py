"""langchain-tests standard unit tests for ChatKVBoost (tiny model)."""

from __future__ import annotations

import functools
from typing import Any

from langchain_kvboost import ChatKVBoost
from langchain_tests.unit_tests import ChatModelUnitTests


@functools.cache
def _shared_tiny_engine() -> Any:
    """One tiny random-weight engine for every model the suite builds."""
    from kvboost_rag import KVBoost
    from kvboost_rag.dev.testing import tiny_model, tiny_tokenizer

    return KVBoost.from_model(tiny_model("llama"), tiny_tokenizer(), chunk_size=16, show_progress=False)


class TestChatKVBoostStandard(ChatModelUnitTests):
    """Tool calling, tool choice, structured output and JSON mode are on (the suite finds the
    first three from the overridden methods); media inputs stay off (text-only model)."""

    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": _shared_tiny_engine()}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True
