"""Drafting on the real embedded model, which quotes its documents: drafts come from the
documents' stored indexes and the answer so far, and the answer stays plain greedy decoding's."""

import pytest
from decoding_checks import margins

from kvboost_rag.corpus import python_reference_topics
from kvboost_rag.decode.draft_policy import DraftPolicy

pytestmark = pytest.mark.slow


@pytest.fixture
def quoting_prompt(embedded_engine):
    topics = python_reference_topics()
    docs = [topics[name][:700] for name in ("pass", "assert", "break")]
    embedded_engine.warm_documents(docs)
    messages = [
        {"role": "system", "content": "Answer from the documents below and quote them."},
        {"role": "user", "content": "\n\n".join(reversed(docs)) + "\n\nQuote the document about the pass statement word for word."},
    ]
    return embedded_engine.apply_chat_template(messages)


def test_drafts_from_the_documents_keep_the_greedy_answer(embedded_engine, quoting_prompt, monkeypatch):
    engine = embedded_engine
    try:
        engine.settings.draft_tokens = 0
        plain = engine.generate(quoting_prompt, max_new_tokens=48, return_logits=True)
        engine.settings.draft_tokens = 15
        measured = engine.generate(quoting_prompt, max_new_tokens=48)  # the policy as shipped
        sources: list[str] = []
        length = DraftPolicy.length

        def always(self, sequence, source, match, available, rows):
            sources.append(source)
            return min(available, self.max_tokens)

        monkeypatch.setattr(DraftPolicy, "length", always)
        forced = engine.generate(quoting_prompt, max_new_tokens=48)
        monkeypatch.setattr(DraftPolicy, "length", length)
    finally:
        engine.settings.draft_tokens = 15
    assert "document" in sources
    assert forced.drafted_tokens >= 8, "a quoting answer accepts drafts from its documents"
    # A verify step computes each token as a one-token step would (bitwise where every layer
    # reads 4-bit runs or int8); a float32 output layer's product may round otherwise by ~3e-5.
    tie = 1e-4
    for run in (measured, forced):
        for step, margin in enumerate(margins(plain.step_logits)):
            if margin <= tie:
                break
            assert run.token_ids[step] == plain.token_ids[step], step
        assert run.generated_tokens == 1 + run.decode_steps + run.drafted_tokens or run.finish_reason != "length"
