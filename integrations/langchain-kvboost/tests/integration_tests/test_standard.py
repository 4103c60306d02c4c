"""langchain-tests standard integration tests for ChatKVBoost on the embedded model."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
)
from langchain_kvboost import ChatKVBoost
from langchain_tests.integration_tests import ChatModelIntegrationTests

SYSTEM = "You are a concise assistant for questions about the Python programming language."


@pytest.mark.slow
class TestChatKVBoostIntegration(ChatModelIntegrationTests):
    """Tool calling, tool choice, structured output (all found by the suite from the
    overridden methods) and JSON mode are on; media inputs stay off (text-only model). Cache
    reads are reported, so the suite's cache-read checks are switched on."""

    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Every instance shares the one embedded-model engine; short answers keep it quick, and
        # 48 tokens hold the suite's tool calls and structured outputs; a mild repetition penalty
        # keeps the 135M model from repeating a phrase inside a JSON string until the budget ends.
        return {"max_new_tokens": 48, "repetition_penalty": 1.2}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(
        self,
    ) -> dict[Literal["invoke", "stream"], list[Any]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = ChatKVBoost(max_new_tokens=8)
        messages = [SystemMessage(SYSTEM), HumanMessage("What is a list?")]
        model.invoke(messages)
        if not stream:
            reply = model.invoke([SystemMessage(SYSTEM), HumanMessage("What is a tuple?")])
            assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
            return reply
        full: AIMessageChunk | None = None
        for chunk in model.stream([SystemMessage(SYSTEM), HumanMessage("What is a set?")]):
            full = chunk if full is None else full + chunk
        assert full is not None and full.usage_metadata["input_token_details"]["cache_read"] > 0
        return full

    # The two tests below leave the choice to the model or test what it writes inside a valid
    # call; decoding guarantees the call's shape, not these choices, and the 135M model gets
    # them wrong (seen on the embedded SmolLM2-135M-Instruct).
    @pytest.mark.xfail(
        reason="with tool_choice='auto' the 135M model answers 'What is the weather in San Francisco?' "
        "in text instead of calling get_weather",
        strict=False,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="the call is forced and valid, but the 135M model writes a placeholder "
        "('{{company.address}}') instead of copying the Chinese customer name",
        strict=False,
    )
    def test_unicode_tool_call_integration(self, model: Any) -> None:
        super().test_unicode_tool_call_integration(model)
