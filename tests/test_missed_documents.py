"""A prompt that holds no prewarmed document logs one rate-limited warning saying why."""

from __future__ import annotations

import logging

import pytest

import kvboost_rag.generation.completion as engine_module
from kvboost_rag.generation.missed_documents import explain_missed_documents, unescape
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.documents import DocumentRegistry

LEAD = "Answer from the documents below.\n\n"


@pytest.fixture(autouse=True)
def fresh_rate_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other tests may have logged this kind within the interval.
    monkeypatch.setattr(engine_module, "_warnings", RateLimitedLogger(engine_module.logger))


def _missed_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "none was found" in r.getMessage()]


def test_escaped_documents_are_named_as_the_cause(make_engine, docs, caplog) -> None:
    engine = make_engine(store_prompt_blocks=False)  # the prompt's own blocks would be stored and found next time
    engine.warm_documents(docs[:3])
    prompt = LEAD + repr(docs[:3]) + "\n\nQuestion: what?"
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        result = engine.generate(prompt, max_new_tokens=2)
        engine.generate(prompt + " Again?", max_new_tokens=2)
    assert result.documents_found == 0
    messages = _missed_warnings(caplog)
    assert len(messages) == 1  # rate-limited: the second prompt is not logged
    assert "3 documents are prewarmed" in messages[0] and "escaped" in messages[0]
    assert "compact" in messages[0]


def test_a_different_document_template_is_named_as_the_cause(make_engine, docs, caplog) -> None:
    engine = make_engine(store_prompt_blocks=False)  # the prompt's own blocks would be stored and found next time
    engine.warm_documents(docs[:3])
    prompt = LEAD + "\n\n".join(f"Source: {i}\n" + d.upper() for i, d in enumerate(docs[:3])) + "\n\nQ?"
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        engine.generate(prompt, max_new_tokens=2)
    (message,) = _missed_warnings(caplog)
    assert "warmed text exactly" in message and "document_prompt" in message


def test_no_warning_when_documents_are_found_or_none_were_prewarmed(make_engine, docs, caplog) -> None:
    engine = make_engine()
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        engine.generate(LEAD + "\n\n".join(docs[:3]) + "\n\nQ?", max_new_tokens=2)  # nothing prewarmed
        engine.warm_documents(docs[3:5])
        found = engine.generate(LEAD + "\n\n".join(docs[3:5]) + "\n\nQ?", max_new_tokens=2)
        engine.generate("Say hi.", max_new_tokens=2)  # short: nothing worth a warning
    assert found.documents_found == 2
    assert _missed_warnings(caplog) == []


def test_explanations_are_pure_functions_of_prompt_and_registry(make_engine, docs) -> None:
    assert unescape("a\\nb\\'c\\\\") == "a\nb'c\\"
    engine = make_engine()
    engine.warm_documents(docs[:1])
    registry = engine._cache.index.known_documents()
    assert "escaped" in explain_missed_documents(repr(docs[0]), registry)
    assert "exactly" in explain_missed_documents("unrelated text", registry)
    assert "exactly" in explain_missed_documents(repr(docs[0]), DocumentRegistry())
