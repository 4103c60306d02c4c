"""What ``HuggingFaceLLM`` users type works, mapped onto the engine, or fails naming the fix."""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.llms.kvboost import KVBoostLLM

from kvboost_rag.dev.testing import save_tiny_model
from kvboost_rag.errors import InvalidInputError


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_hugging_face_llm_arguments_are_honoured(model_folder: str) -> None:
    llm = KVBoostLLM(
        model_name=model_folder,
        tokenizer_name=model_folder,
        generate_kwargs={"temperature": 1.5, "do_sample": True},
        device_map="cpu",
        context_window=256,
        max_new_tokens=6,
        model_kwargs={"torch_dtype": "float32"},
        query_wrapper_prompt="<|user|>{query_str}<|assistant|>",
        set_global_tokenizer=False,
    )
    assert llm.temperature == 1.5 and llm.max_new_tokens == 6
    assert llm.metadata.context_window == 256
    assert llm.engine.settings.device == "cpu" and llm.engine.settings.dtype == "float32"
    assert llm.model_path == model_folder
    assert llm.completion_to_prompt("hi") == "<|user|>hi<|assistant|>"
    assert llm.complete("What is a list?").raw["generated_tokens"] <= 6


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"generate_kwargs": {"top_k": 10}}, "top_p"),
        ({"generate_kwargs": {"temperature": 0.7}, "temperature": 0.2}, "disagree"),
        ({"device_map": "balanced"}, "one device"),
        ({"tokenizer_name": "another/tokenizer"}, "own tokenizer"),
        ({"tokenizer_kwargs": {"padding_side": "left"}}, "pass model= and tokenizer="),
        ({"stopping_ids": [2]}, "stop="),
        ({"model_kwargs": {"load_in_8bit": True}}, "pass model= and tokenizer="),
        ({"query_wrapper_prompt": "no placeholder"}, "query_str"),
    ],
)
def test_arguments_it_cannot_honour_raise(model_folder: str, arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        KVBoostLLM(model_name=model_folder, set_global_tokenizer=False, **arguments)
