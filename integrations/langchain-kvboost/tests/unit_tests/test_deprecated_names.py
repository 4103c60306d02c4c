"""Old names (before both integrations shared one vocabulary) still work and warn once."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from langchain_kvboost import ChatKVBoost, KVBoostLLM, KVBoostRetrievalWarmer

# Each test sees the first use of an old name (kvboost_rag.pytest_isolation).
pytestmark = pytest.mark.usefixtures("fresh_deprecation_warnings")


def test_retriever_warmer_old_name(engine: Any) -> None:
    import langchain_kvboost
    import langchain_kvboost.callbacks

    with pytest.warns(DeprecationWarning, match="KVBoostRetrieverWarmer is deprecated.*KVBoostRetrievalWarmer"):
        from langchain_kvboost import KVBoostRetrieverWarmer
    assert KVBoostRetrieverWarmer is KVBoostRetrievalWarmer
    with pytest.warns(DeprecationWarning, match="callbacks.KVBoostRetrieverWarmer"):
        assert langchain_kvboost.callbacks.KVBoostRetrieverWarmer is KVBoostRetrievalWarmer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert langchain_kvboost.KVBoostRetrieverWarmer is KVBoostRetrievalWarmer  # warned once
    warmer = KVBoostRetrievalWarmer(engine)
    with pytest.warns(DeprecationWarning, match=r"wait\(\) is deprecated.*wait_idle\(\)"):
        assert warmer.wait(timeout=5)
    warmer.close()


def test_engine_kwargs_is_the_old_name_of_engine_settings(engine: Any) -> None:
    with pytest.warns(DeprecationWarning, match=r"KVBoostLLM\(engine_kwargs=...\) is deprecated") as record:
        llm = KVBoostLLM(engine=engine, engine_kwargs={})
    assert record[0].filename == __file__
    assert llm.engine is engine and llm.engine_settings == {}
    with pytest.warns(DeprecationWarning, match="engine_kwargs"):
        assert llm.engine_kwargs == {}
    with pytest.raises(ValueError, match="engine_kwargs and engine_settings conflict"), pytest.warns(DeprecationWarning):
        ChatKVBoost(engine_kwargs={"chunk_size": 16}, engine_settings={"chunk_size": 32})
    with pytest.raises(ValueError, match="not both"):
        ChatKVBoost(engine=engine, engine_settings={"chunk_size": 16})
