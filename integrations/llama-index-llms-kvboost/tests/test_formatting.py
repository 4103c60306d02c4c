"""Chat messages as the dicts chat templates read."""

from __future__ import annotations

from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.llms.kvboost.formatting import message_dicts


def test_message_dicts_maps_llamaindex_roles() -> None:
    dicts = message_dicts(
        [
            ChatMessage(role=MessageRole.DEVELOPER, content="rules"),
            ChatMessage(role=MessageRole.CHATBOT, content="hello"),
            ChatMessage(role=MessageRole.USER, content=None),
        ]
    )
    assert dicts == [
        {"role": "system", "content": "rules"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": ""},
    ]
