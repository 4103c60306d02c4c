"""Renamed public names keep working and warn once."""

from __future__ import annotations

import types
import warnings

import pytest

from kvboost_rag import deprecation


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deprecation, "_warned", set())


def test_warns_once_per_name() -> None:
    with pytest.warns(DeprecationWarning, match="old_name is deprecated.*use new_name"):
        deprecation.warn_deprecated("old_name", "new_name")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deprecation.warn_deprecated("old_name", "new_name")  # second use: silent
    with pytest.warns(DeprecationWarning, match="other_name"):
        deprecation.warn_deprecated("other_name", "new_name")


def test_module_getattr_serves_renamed_names() -> None:
    module = types.ModuleType("pkg")
    module.New = object()

    def getattr_(name: str) -> object:
        return deprecation.renamed_module_attribute("pkg", name, {"Old": "New"}, vars(module))

    module.__getattr__ = getattr_  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="pkg.Old is deprecated.*pkg.New") as record:
        assert module.Old is module.New
    assert record[0].filename == __file__  # points at the code that used the old name
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        module.Missing  # noqa: B018
