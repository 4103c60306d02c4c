"""engine_registry: one way for both integrations to get their engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvboost_rag import KVBoost, ModelNotFoundError
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.integration.engine_registry import (
    ArgumentNames,
    clear_shared_engines,
    engine_of,
    resolve_engine,
)


@pytest.fixture
def tiny_folder(tmp_path: Path, tokenizer) -> Path:
    tiny_model("llama").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_a_given_engine_is_used_as_is(make_engine) -> None:
    engine = make_engine()
    assert resolve_engine(engine) is engine
    assert resolve_engine(engine, settings={}) is engine


def test_folder_engines_are_shared_by_folder_and_settings(tiny_folder: Path) -> None:
    try:
        first = resolve_engine(model_path=tiny_folder, settings={"chunk_size": 16, "show_progress": False})
        again = resolve_engine(model_path=str(tiny_folder), settings={"show_progress": False, "chunk_size": 16})
        other = resolve_engine(model_path=tiny_folder, settings={"chunk_size": 32, "show_progress": False})
        assert first is again and other is not first
    finally:
        clear_shared_engines()


def test_a_loaded_model_gets_its_own_engine(tokenizer) -> None:
    model = tiny_model("llama")
    first = resolve_engine(model=model, tokenizer=tokenizer, settings={"show_progress": False})
    second = resolve_engine(model=model, tokenizer=tokenizer, settings={"show_progress": False})
    assert first.model is model and first is not second


def test_errors_name_the_callers_arguments(make_engine, tokenizer) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="only one of engine=, model_path=, not both"):
        resolve_engine(engine, model_path="/somewhere")
    custom = ArgumentNames(model_path="model", settings="kvboost_settings")
    with pytest.raises(ValueError, match="only one of engine=, model=, not both"):
        resolve_engine(engine, model_path="/somewhere", names=custom)
    with pytest.raises(ValueError, match="engine= or kvboost_settings="):
        resolve_engine(engine, settings={"recompute_ratio": 0.2}, names=custom)
    with pytest.raises(ValueError, match="go together"):
        resolve_engine(model=object())
    with pytest.raises(ValueError, match="must be a kvboost_rag.KVBoost"):
        resolve_engine("not an engine")


def test_unknown_folder_raises_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        resolve_engine(model_path=tmp_path / "missing-model")


def test_engine_of(make_engine) -> None:
    engine = make_engine()

    class Holder:
        def __init__(self, engine: KVBoost) -> None:
            self.engine = engine

    assert engine_of(engine) is engine and engine_of(Holder(engine)) is engine
    with pytest.raises(TypeError, match="KVBoost"):
        engine_of(object())
