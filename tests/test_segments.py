import pytest

from kvboost_rag.request.documents import (
    ANCHOR_CHARS,
    DocumentOccurrence,
    DocumentRecord,
    DocumentRegistry,
    PromptIndex,
    align_tokens,
    anchor_of,
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


@pytest.mark.parametrize(
    "prefix",
    ["Context:\n", "Context: ", "x", "Docs:\n\n", "### ", "(", "résumé — ", "🙂 ", "\t"],
)
def test_vectorized_alignment_equals_token_by_token(tokenizer, prefix, monkeypatch):
    """Real documents (some with multi-byte characters) after prefixes that merge or do not
    merge with their first token, and cut short: the fast path gives the same pairs, and it is
    the path taken for documents of one token per character span."""
    from kvboost_rag.corpus import python_reference_documents
    from kvboost_rag.request import documents as segments
    from kvboost_rag.request.documents import _align_one_by_one

    fallbacks: list[str] = []
    monkeypatch.setattr(segments, "_align_one_by_one", lambda occ, *a: fallbacks.append(occ.record.text) or _align_one_by_one(occ, *a))

    texts = [*python_reference_documents(max_chars=400)[:4], "Émoji 🙂 and naïve café — “quotes” " * 4]
    for doc in texts:
        enc = tokenizer(doc, add_special_tokens=False, return_offsets_mapping=True)
        rec = DocumentRecord("d", doc, tuple(enc.input_ids), tuple(map(tuple, enc.offset_mapping)), ("k",), 32)
        for prompt in (prefix + doc + "\n\nQuestion?", prefix + doc[: len(doc) // 2]):
            penc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(penc.input_ids), [tuple(o) for o in penc.offset_mapping]
            index = PromptIndex(len(prompt), ids, offsets)
            occ = DocumentRegistry().find(prompt, explicit=[rec])[0] if prompt.find(doc) >= 0 else None
            if occ is None:  # the cut prompt holds a leading part only
                occ = DocumentOccurrence(rec, len(prefix), common_prefix_length(prompt, len(prefix), doc))
            fast = DocumentOccurrence(rec, occ.char_start, occ.matched_chars)
            align_tokens(fast, index)
            slow = DocumentOccurrence(rec, occ.char_start, occ.matched_chars)
            count = sum(1 for _, end in rec.offsets if end <= occ.matched_chars)
            _align_one_by_one(slow, index, count)
            assert (fast.positions, fast.rows, fast.merged_tokens) == (slow.positions, slow.rows, slow.merged_tokens)
            assert fast.positions, "something aligned"
    assert all(DocumentRecord("d", t, *_spans(tokenizer, t)).shared_spans for t in fallbacks), fallbacks


def _spans(tokenizer, text: str) -> tuple:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return tuple(enc.input_ids), tuple(map(tuple, enc.offset_mapping)), ("k",), 32


def test_window_anchors_equal_the_anchor_of_each_window():
    import random

    from kvboost_rag.request.hashing import anchor_hash, window_anchors

    rng = random.Random(3)
    text = "".join(rng.choice("ab cdé\n🙂\U0010fffd\ud800") for _ in range(2000))
    windows = window_anchors(text, ANCHOR_CHARS)
    assert len(windows) == len(text) - ANCHOR_CHARS + 1
    assert all(int(windows[i]) == anchor_hash(text[i : i + ANCHOR_CHARS]) for i in range(len(windows)))
    assert len(window_anchors("short", ANCHOR_CHARS)) == 0


def test_find_after_registrations_and_forgetting_equals_a_plain_scan():
    """Hundreds of documents registered and forgotten (the anchor filter grows and shrinks):
    find returns exactly the registered documents a plain scan finds, in order."""
    import random

    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "scope", "import", "yield", "lambda", "class", "async"]
    texts = [" ".join(rng.choice(words) for _ in range(20)) + f" #{i}" for i in range(600)]
    reg = DocumentRegistry()
    for text in texts:
        reg.register(record(text))
    forgotten = set(rng.sample(range(600), 450))
    for i in forgotten:
        assert reg.forget(anchor_of(texts[i]), texts[i])
    kept = [i for i in range(600) if i not in forgotten]
    chosen = rng.sample(range(600), 40)
    prompt = "System.\n\n" + "\n\n".join(texts[i] for i in chosen) + "\n\nQuestion?"
    found = [o.record.text for o in reg.find(prompt)]
    expected = [texts[i] for i in chosen if i in set(kept)]
    assert found == expected and len(reg) == len(kept)


def test_aligning_all_documents_at_once_equals_aligning_each(tokenizer):
    """One prompt holding documents that align whole, documents whose edges merge with their
    neighbours, a leading part, and documents of multi-byte characters: aligning them together
    gives each document the pairs and merged count of aligning it alone."""
    from kvboost_rag.corpus import python_reference_documents
    from kvboost_rag.request.documents import align_all

    texts = [*python_reference_documents(max_chars=300)[:5], "Émoji 🙂 and naïve café — “quotes” " * 3]
    records = [DocumentRecord(str(i), t, *_spans(tokenizer, t)) for i, t in enumerate(texts)]
    prompt = "Intro" + texts[0] + "\n\n" + texts[1] + "s" + texts[2] + "\n\n" + texts[5] + texts[3] + "\n\n" + texts[4][:90]
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    index = PromptIndex(len(prompt), list(enc.input_ids), [tuple(o) for o in enc.offset_mapping])
    found = DocumentRegistry().find(prompt, explicit=records[:4] + records[5:])
    found.append(DocumentOccurrence(records[4], prompt.rindex(texts[4][:90]), 90))
    together = [DocumentOccurrence(o.record, o.char_start, o.matched_chars) for o in found]
    align_all(together, index)
    for occurrence, joint in zip(found, together):
        align_tokens(occurrence, index)
        assert (joint.positions, joint.rows, joint.merged_tokens) == (occurrence.positions, occurrence.rows, occurrence.merged_tokens)
    assert any(o.merged_tokens for o in found) and any(o.positions and not o.merged_tokens for o in found)
