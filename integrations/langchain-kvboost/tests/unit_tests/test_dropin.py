"""What ``HuggingFacePipeline`` / ``ChatHuggingFace`` users type works, mapped onto the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_kvboost import ChatKVBoost, KVBoostLLM

from kvboost_rag.dev.testing import save_tiny_model, tiny_model, tiny_tokenizer
from kvboost_rag.errors import InvalidInputError


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_from_model_id_maps_pipeline_arguments(model_folder: str) -> None:
    llm = KVBoostLLM.from_model_id(
        model_id=model_folder,
        task="text-generation",
        pipeline_kwargs={"max_new_tokens": 5, "temperature": 1.5, "top_p": 0.9, "return_full_text": False},
        device=-1,
        model_kwargs={"torch_dtype": "float32"},
    )
    assert (llm.max_new_tokens, llm.temperature, llm.top_p) == (5, 1.5, 0.9)
    assert llm.engine.settings.device == "cpu" and llm.engine.settings.dtype == "float32"
    assert Path(llm.model or "") == Path(model_folder)
    result = llm.generate(["Question: what is a tuple?"]).generations[0][0]
    assert 0 < result.generation_info["generated_tokens"] <= 5


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"task": "summarization"}, "text-generation"),
        ({"pipeline_kwargs": {"top_k": 10}}, "top_p"),
        ({"pipeline_kwargs": {"do_sample": False, "temperature": 0.7}}, "drop do_sample"),
        ({"device_map": {"": 0}}, "one device"),
        ({"backend": "openvino"}, "PyTorch"),
        ({"batch_size": 8}, "one at a time"),
    ],
)
def test_from_model_id_refuses_what_it_cannot_honour(model_folder: str, arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        KVBoostLLM.from_model_id(model_id=model_folder, **arguments)


def test_chat_from_a_kvboost_llm_takes_its_engine_and_settings(engine: Any) -> None:
    llm = KVBoostLLM(engine=engine, max_new_tokens=3, temperature=0.5, seed=7, stop=["\n"])
    chat = ChatKVBoost(llm=llm)
    assert chat.engine is engine
    assert (chat.max_new_tokens, chat.temperature, chat.seed, chat.stop) == (3, 0.5, 7, ["\n"])
    assert ChatKVBoost(llm=llm, max_new_tokens=9).max_new_tokens == 9  # given fields win
    with pytest.raises(ValueError, match="not both"):
        ChatKVBoost(llm=llm, engine=engine)
    with pytest.raises(ValueError, match="KVBoostLLM or a HuggingFacePipeline"):
        ChatKVBoost(llm=object())


def test_chat_from_a_hugging_face_pipeline_runs_its_model() -> None:
    from langchain_huggingface import HuggingFacePipeline
    from transformers import pipeline

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    hf = HuggingFacePipeline(
        pipeline=pipeline("text-generation", model=model, tokenizer=tokenizer),
        pipeline_kwargs={"max_new_tokens": 4, "do_sample": True, "temperature": 0.8},
    )
    chat = ChatKVBoost(llm=hf, engine_settings={"chunk_size": 16})
    assert chat.engine.model is model and chat.engine.settings.chunk_size == 16
    assert (chat.max_new_tokens, chat.temperature) == (4, 0.8)
    reply = chat.invoke("What is a list?")
    assert reply.response_metadata["generated_tokens"] <= 4
