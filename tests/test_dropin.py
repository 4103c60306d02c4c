"""Transformers-style arguments mapped onto the engine, or refused with the alternative named."""

from __future__ import annotations

import pytest
import torch

from kvboost_rag.errors import InvalidInputError
from kvboost_rag.integration.dropin import (
    device_setting,
    generation_fields,
    model_settings,
)


def test_generation_arguments_map_onto_fields() -> None:
    assert generation_fields({"temperature": 1.5}, "generate_kwargs") == {"temperature": 1.5}
    assert generation_fields({"do_sample": True}, "g") == {"temperature": 1.0}
    assert generation_fields({"do_sample": True, "temperature": 0.7, "top_p": 0.9}, "g") == {"temperature": 0.7, "top_p": 0.9}
    assert generation_fields({"do_sample": False, "max_new_tokens": 64}, "g") == {"temperature": 0.0, "max_new_tokens": 64}
    assert generation_fields({"return_full_text": False, "seed": 3}, "g") == {"seed": 3}
    assert generation_fields(None, "g") == {}


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"top_k": 50}, "top_p"),
        ({"max_length": 100}, "max_new_tokens"),
        ({"num_beams": 4}, "greedy"),
        ({"return_full_text": True}, "return_full_text=False"),
        ({"do_sample": False, "temperature": 1.5}, "drop do_sample"),
        ({"typical_p": 0.9}, "supported: max_new_tokens"),
    ],
)
def test_unsupported_generation_arguments_name_the_alternative(kwargs, named) -> None:
    with pytest.raises(InvalidInputError, match=named):
        generation_fields(kwargs, "pipeline_kwargs")


def test_devices_and_dtypes() -> None:
    assert device_setting(-1) == "cpu"
    assert device_setting(0) == "cuda:0"
    assert device_setting(None, "auto") is None
    assert device_setting(None, "cuda") == "cuda"
    assert device_setting("cpu", "cpu") == "cpu"
    for bad in ({"": 0}, "balanced"):
        with pytest.raises(InvalidInputError, match="one device"):
            device_setting(None, bad)
    with pytest.raises(InvalidInputError, match="disagree"):
        device_setting(-1, "cuda")
    assert model_settings({"torch_dtype": torch.bfloat16}) == {"dtype": "bfloat16"}
    assert model_settings({"dtype": "auto"}) == {}
    with pytest.raises(InvalidInputError, match="pass model= and tokenizer="):
        model_settings({"attn_implementation": "sdpa"})
