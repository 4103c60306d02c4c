import pytest

from kvboost_rag.segments import (
    ANCHOR_CHARS,
    DocumentRecord,
    DocumentRegistry,
    PromptIndex,
    align_tokens,
    common_prefix_length,
)


def record(text: str, digest: str | None = None) -> DocumentRecord:
    return DocumentRecord(digest or text, text, (), (), (), 32)


DOC_A = "Alpha document: the quick brown fox jumps over the lazy dog. " * 3
DOC_B = "Beta document talks about Python scoping rules and name binding. " * 3
DOC_C = "Gamma document explains the import system and module caching. " * 3


@pytest.fixture
def registry():
    reg = DocumentRegistry()
    for text in (DOC_A, DOC_B, DOC_C):
        reg.register(record(text))
    return reg


@pytest.mark.parametrize("order", [(DOC_A, DOC_B, DOC_C), (DOC_C, DOC_A, DOC_B), (DOC_B, DOC_C, DOC_A)])
def test_documents_found_in_any_order_and_offset(registry, order):
    prompt = "System.\n\n" + "\n---\n".join(order) + "\nQ?"
    found = registry.find(prompt)
    assert [o.record.text for o in found] == list(order)
    for occ in found:
        assert prompt[occ.char_start : occ.char_start + occ.matched_chars] == occ.record.text
        assert occ.is_whole


def test_truncated_document_matches_its_leading_part(registry):
    cut = DOC_B[:70]
    found = registry.find("ctx " + cut + " and something else entirely")
    assert len(found) == 1
    assert found[0].record.text == DOC_B
    assert found[0].matched_chars == 70
    assert not found[0].is_whole


def test_unknown_text_misses(registry):
    assert registry.find("Nothing here resembles any registered document at all, really.") == []


def test_short_documents_need_explicit_passing(registry):
    short = record("tiny doc")
    assert registry.find("before tiny doc after") == []
    found = registry.find("before tiny doc after", explicit=[short])
    assert [(o.char_start, o.matched_chars) for o in found] == [(7, 8)]


def test_start_skips_the_shared_beginning(registry):
    prompt = DOC_A + "\n" + DOC_B
    assert [o.record.text for o in registry.find(prompt, start=len(DOC_A))] == [DOC_B]


def test_scan_is_linear_in_prompt_not_corpus():
    reg = DocumentRegistry()
    for i in range(5000):
        reg.register(record(f"document number {i:05d} " + "x" * ANCHOR_CHARS))
    prompt = "q " * 2000 + f"document number 04321 {'x' * ANCHOR_CHARS}"
    found = reg.find(prompt)
    assert [o.record.text for o in found] == [f"document number 04321 {'x' * ANCHOR_CHARS}"]


def test_common_prefix_length():
    assert common_prefix_length("xxabcd", 2, "abcz") == 3
    assert common_prefix_length("xxabc", 2, "abc") == 3
    assert common_prefix_length("xxq", 2, "abc") == 0
    assert common_prefix_length("ab", 0, "abcdef") == 2


def _occurrence(tokenizer, prefix: str, doc: str):
    enc = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)
    rec = DocumentRecord("d", doc, tuple(enc.input_ids), tuple(map(tuple, enc.offset_mapping)), ("k",), 32)
    prompt = prefix + doc
    penc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(penc.input_ids), [tuple(o) for o in penc.offset_mapping]
    occ = DocumentRegistry().find(prompt, explicit=[rec])[0]
    align_tokens(occ, PromptIndex(len(prompt), ids, offsets))
    return occ, ids, rec


def test_alignment_on_a_clean_boundary(tokenizer):
    occ, ids, rec = _occurrence(tokenizer, "Context:\n", "value of the expression")
    assert occ.merged_tokens == 0
    assert [ids[j] for j, _ in occ.aligned] == list(rec.token_ids)


def test_alignment_counts_tokens_merged_across_the_boundary(tokenizer):
    occ, ids, rec = _occurrence(tokenizer, "Context: ", "value of the expression")
    assert occ.merged_tokens >= 1  # " value" (with the space) is one token in the prompt
    assert len(occ.aligned) + occ.merged_tokens == len(rec.token_ids)
    for j, k in occ.aligned:
        assert ids[j] == rec.token_ids[k]


def test_documents_with_multi_token_characters_are_stored_and_served_whole(make_engine, docs, tokenizer):
    """A character the tokenizer splits into several tokens (an emoji, a rare letter) gives
    them all one span; every one of them still aligns, so no chunk of the document is lost."""
    from rag_prompts import SYSTEM_PROMPT, rag_prompt

    special = "🦜️🔗 naïve café — 日本語"
    spans = [tuple(o) for o in tokenizer(special, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    assert len(spans) > len(set(spans)), "the text must hold characters split into several tokens"
    texts = [d[:150] + " " + special + " " + d[150:] + " " + special for d in docs[:4]]
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT)
    results = engine.warm_documents(texts)
    assert all(r.kept_in == ["memory"] and r.new_tokens == r.num_tokens for r in results)
    assert all(engine.is_document_warm(text) for text in texts)
    result = engine.generate(rag_prompt(texts[::-1]), max_new_tokens=1)
    assert result.documents_found == 4
    assert result.boundary_merged_tokens <= 4 * 2  # at most the seams' tokens, never the characters'
