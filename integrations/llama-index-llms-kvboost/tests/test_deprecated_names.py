"""Old names (before both integrations shared one vocabulary) still work and warn once."""

from __future__ import annotations

import warnings

import pytest
from llama_index.llms.kvboost import KVBoostPrewarmer

from kvboost_rag import KVBoost


# Each test sees the first use of an old name (kvboost_rag.pytest_isolation).
pytestmark = pytest.mark.usefixtures("fresh_deprecation_warnings")


def test_prewarm_old_name(tiny_engine: KVBoost) -> None:
    import llama_index.llms.kvboost
    import llama_index.llms.kvboost.prewarm

    with pytest.warns(DeprecationWarning, match="KVBoostPrewarm is deprecated.*KVBoostPrewarmer"):
        from llama_index.llms.kvboost import KVBoostPrewarm
    assert KVBoostPrewarm is KVBoostPrewarmer
    assert isinstance(KVBoostPrewarm(engine=tiny_engine), KVBoostPrewarmer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert llama_index.llms.kvboost.KVBoostPrewarm is KVBoostPrewarmer  # warned once
    with pytest.warns(DeprecationWarning, match="prewarm.KVBoostPrewarm"):
        assert llama_index.llms.kvboost.prewarm.KVBoostPrewarm is KVBoostPrewarmer
