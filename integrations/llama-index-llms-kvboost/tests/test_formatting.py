"""Shared-beginning detection over chat templates and completion prompts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.llms.kvboost.formatting import (
    chat_shared_beginning,
    message_dicts,
    text_shared_beginning,
)

from kvboost_rag.testing import tiny_tokenizer

# A template that inserts a default system turn when the conversation has none (as
# SmolLM2-Instruct's does).
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _ids(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _renderer(tokenizer, template: str | None = None):
    def render(messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            message_dicts(messages), tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template
        )

    return render


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


def test_system_turn_and_user_header_are_the_shared_beginning(tokenizer) -> None:
    render = _renderer(tokenizer)
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="What is a list?"),
    ]
    prompt = render(messages, True)
    shared = chat_shared_beginning(messages, prompt, render, _ids(tokenizer))
    assert shared == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    other = render([messages[0], ChatMessage(role=MessageRole.USER, content="Why?")], True)
    assert other.startswith(shared)  # every question behind this system turn shares it
    ids = _ids(tokenizer)
    assert ids(prompt)[: len(ids(shared))] == ids(shared)


def test_default_system_turn_of_the_template_is_shared_without_a_system_message(tokenizer) -> None:
    render = _renderer(tokenizer, DEFAULT_SYSTEM_TEMPLATE)
    messages = [ChatMessage(role=MessageRole.USER, content="Refine the answer.")]
    prompt = render(messages, True)
    shared = chat_shared_beginning(messages, prompt, render, _ids(tokenizer))
    assert shared == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"


def test_generic_rendering_shares_the_system_line(tokenizer) -> None:
    def render(messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        return generic_messages_to_prompt(messages)

    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="What is a list?"),
    ]
    prompt = render(messages, True)
    # The system message alone renders with a trailing "assistant: ", not a prefix; the
    # rendering up to the user's content is, less the space that the tokenizer joins to the
    # content's first word.
    assert chat_shared_beginning(messages, prompt, render, _ids(tokenizer)) == "system: Be brief.\nuser:"


def test_no_shared_beginning_when_the_prompt_is_only_the_beginning(tokenizer) -> None:
    render = _renderer(tokenizer)
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Only a system turn.")]
    prompt = render(messages, False)
    assert chat_shared_beginning(messages, prompt, render, _ids(tokenizer)) is None


def test_completion_system_prompt_is_cut_on_a_token_boundary(tokenizer) -> None:
    ids = _ids(tokenizer)
    system = "Answer from the context only."
    prompt = system + "\n\nContext information is below."
    shared = text_shared_beginning(system, prompt, ids)
    assert shared is not None and prompt.startswith(shared) and shared.startswith(system)
    # Whatever was kept, its tokens are exactly the prompt's first tokens.
    assert ids(prompt)[: len(ids(shared))] == ids(shared)
    # "\n\n" before a word tokenizes differently from "\n\n" alone in this tokenizer.
    assert ids(system + "\n\n") != ids(prompt)[: len(ids(system + "\n\n"))]
    assert shared != system + "\n\n"


def test_completion_without_the_system_prompt_has_no_shared_beginning(tokenizer) -> None:
    ids = _ids(tokenizer)
    assert text_shared_beginning("Be brief.", "Something else entirely", ids) is None
    assert text_shared_beginning(None, "Be brief.\n\nQuestion", ids) is None
