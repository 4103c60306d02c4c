"""Documents are warmed behind other documents of the corpus (``warm_context_documents``)."""

from __future__ import annotations

import pytest
from rag_prompts import SYSTEM_PROMPT

from kvboost_rag import KVBoost
from kvboost_rag.cache.manager import CacheManager
from kvboost_rag.dev.testing import tiny_model
from kvboost_rag.warming import CONTEXT_DOCUMENT_SEPARATOR


def _warmed_texts(engine: KVBoost, texts: list[str], monkeypatch) -> dict[str, str]:
    """Document text -> the whole text it was computed in (context, then the document)."""
    seen: dict[str, str] = {}
    write_back = CacheManager.write_back

    def spy(self, plan, outcome, **kwargs):
        for document in plan.documents:
            seen[document.record.text] = plan.tokens.text
        return write_back(self, plan, outcome, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(CacheManager, "write_back", spy)
        engine.warm_documents(texts)
    return seen


@pytest.mark.parametrize("batch_tokens", [0, 4096])
def test_each_document_is_warmed_behind_another_but_never_itself(make_engine, docs, monkeypatch, batch_tokens):
    engine = make_engine("llama", warm_context_documents=1, warm_batch_tokens=batch_tokens)
    engine.warm(SYSTEM_PROMPT)
    seen = _warmed_texts(engine, docs[:4], monkeypatch)
    first, second = docs[0], docs[1]
    assert seen[first] == SYSTEM_PROMPT + second + CONTEXT_DOCUMENT_SEPARATOR + first
    for text in docs[1:4]:
        behind = second if text == first else first
        assert seen[text] == SYSTEM_PROMPT + behind + CONTEXT_DOCUMENT_SEPARATOR + text
    # A later call keeps the same context documents.
    later = _warmed_texts(engine, docs[4:6], monkeypatch)
    assert later == {text: SYSTEM_PROMPT + first + CONTEXT_DOCUMENT_SEPARATOR + text for text in docs[4:6]}


def test_two_context_documents_and_none(make_engine, docs, monkeypatch):
    two = make_engine("llama", warm_context_documents=2)
    two.warm(SYSTEM_PROMPT)
    seen = _warmed_texts(two, docs[:4], monkeypatch)
    sep = CONTEXT_DOCUMENT_SEPARATOR
    assert seen[docs[3]] == SYSTEM_PROMPT + docs[0] + sep + docs[1] + sep + docs[3]
    assert seen[docs[1]] == SYSTEM_PROMPT + docs[0] + sep + docs[2] + sep + docs[1]
    alone = make_engine("llama", warm_context_documents=0)
    alone.warm(SYSTEM_PROMPT)
    assert _warmed_texts(alone, docs[:3], monkeypatch) == {text: SYSTEM_PROMPT + text for text in docs[:3]}


def test_a_document_too_long_for_the_window_is_not_a_context_document(tokenizer, docs, monkeypatch):
    model = tiny_model("llama")
    window = model.config.max_position_embeddings
    long_text = " ".join(docs) * (window // 100)
    engine = KVBoost.from_model(model, tokenizer, show_progress=False, chunk_size=32, warm_context_documents=1)
    assert engine.count_tokens(long_text) > window // 4
    engine.warm(SYSTEM_PROMPT)
    seen = _warmed_texts(engine, [long_text, docs[0], docs[1]], monkeypatch)
    assert seen[docs[1]] == SYSTEM_PROMPT + docs[0] + CONTEXT_DOCUMENT_SEPARATOR + docs[1]
    assert seen[docs[0]] == SYSTEM_PROMPT + docs[1] + CONTEXT_DOCUMENT_SEPARATOR + docs[0]


def test_documents_warmed_behind_others_hit_in_any_prompt(make_engine, docs):
    engine = make_engine("llama", warm_context_documents=1)
    engine.warm(SYSTEM_PROMPT)
    engine.warm_documents(docs[:4])
    prompt = SYSTEM_PROMPT + "\n\n".join([docs[3], docs[0], docs[2]]) + "\n\nQuestion: what is it?\nAnswer:"
    result = engine.generate(prompt, max_new_tokens=2)
    # Every document token is loaded but the few merged across a seam (and the last token).
    assert result.content_hit_tokens >= sum(engine.count_tokens(d) for d in (docs[3], docs[0], docs[2])) - 6
