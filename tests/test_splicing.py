"""Tokenizing once: a prompt spliced from its documents' stored tokens is tokenized exactly as
tokenizing the whole prompt (ids and spans), over many prompts, separators, templates and
tokenizers; and where a joint is not provably safe the text around it is tokenized instead.

Prompts are drawn from a seeded generator (the same prompts at every run): documents cut from
real text at any character, given leading or trailing spaces, punctuation, digits, emoji,
CJK text or combining accents, joined by separators from none to chat-template markup.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from splice_tokenizers import TOKENIZERS, trained

from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.request.documents import ANCHOR_CHARS, DocumentRegistry, make_record
from kvboost_rag.request.splice_support import splice_support
from kvboost_rag.request.splicing import KnownDocument, splice_tokens
from kvboost_rag.request.text import Tokenizing

SEPARATORS = [
    "\n\n", "\n", " ", ":", "", ": ", "\n\n---\n\n", " \n ", "\t", "。", "😀", "12", ".", "'", "  ",
    "<|im_end|>\n<|im_start|>user\n", "<|im_start|>", " <doc> ", "<doc>", "\n</s>",
]
TEMPLATES = [
    "System: answer from the documents.\n\n{documents}\n\nQuestion: what is it?\nAnswer:",
    "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n{documents}\n\nWhat is it?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "{documents}",
    " {documents} ",
    "Context:{documents}Question",
]
EDGES = [
    "", " ", "  ", "\n", ".", "...", "12345", "😀", "日本語", "e\u0301", "\u0301", "'s", "'", "—", "½", "\t", "<doc>", "ﬁ",
]


class _Window:
    context_window = 1 << 30


def _pool() -> str:
    return "\n\n".join(python_reference_documents()[30:60])


def _document(rng: random.Random, pool: str) -> str:
    text = ""
    while not text.strip():  # a slice of a table's blank columns is no document
        length = rng.choice([ANCHOR_CHARS, 40, 70, 150, 400, 900])
        start = rng.randrange(len(pool) - length)
        text = pool[start : start + length]
    return rng.choice(EDGES) + text + rng.choice(EDGES)


def _prompt(rng: random.Random, pool: str) -> tuple[str, list[str]]:
    documents = [_document(rng, pool) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.2:
        documents.append(documents[0])  # the same document twice
    joined = documents[0]
    for document in documents[1:]:
        joined += rng.choice(SEPARATORS) + document
    return rng.choice(TEMPLATES).format(documents=joined), documents


def _whole(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _engine_side(tokenizer) -> tuple[Tokenizing, DocumentRegistry]:
    registry = DocumentRegistry()
    return Tokenizing(tokenizer, _Window(), lambda: registry), registry


def _record(tokenizing: Tokenizing, text: str):
    return tokenizing.record(text, "fp", 16)


def _known(tokenizing: Tokenizing, found) -> list[KnownDocument]:
    return [KnownDocument(o, tokenizing.checked.word_starts(o.record)) for o in found if o.is_whole]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_spliced_tokens_are_the_whole_prompts(name):
    _check_prompts(trained(name), name, 60, declined=name == "no-pre-tokenizer")


def test_spliced_tokens_are_the_whole_prompts_with_the_tests_tokenizer(tokenizer):
    _check_prompts(tokenizer, "tiny", 60)


@pytest.mark.slow
def test_spliced_tokens_are_the_whole_prompts_with_the_embedded_tokenizer():
    from transformers import AutoTokenizer

    from kvboost_rag.default_model import default_model_dir

    _check_prompts(AutoTokenizer.from_pretrained(default_model_dir()), "embedded", 60)


def _check_prompts(tokenizer, name: str, count: int, declined: bool = False) -> None:
    """``count`` generated prompts tokenize spliced exactly as whole; unless splicing is
    ``declined`` for the tokenizer, most document tokens come from the records."""
    support, _ = splice_support(tokenizer)
    assert (support is None) == declined
    tokenizing, registry = _engine_side(tokenizer)
    rng, pool = random.Random(f"splice-{name}"), _pool()
    stored = document_tokens = 0
    for _ in range(count):
        text, documents = _prompt(rng, pool)
        records = [_record(tokenizing, document) for document in documents]
        for record in records:
            registry.register(record)
        explicit = [record for record in records if len(record.text) < ANCHOR_CHARS]
        tokens = tokenizing.prompt(text, find=True, explicit=explicit)
        assert (tokens.ids, tokens.offsets) == _whole(tokenizer, text), text
        assert tokens.found and all(o.record.text in text for o in tokens.found)
        if support is not None:
            known = _known(tokenizing, tokens.found)
            stored += splice_tokens(text, known, support).stored
            document_tokens += sum(len(k.occurrence.record.token_ids) for k in known)
    if support is not None:  # most document tokens come from the records, not from tokenizing again
        assert stored > 0.8 * document_tokens, (stored, document_tokens)


def test_bench_shaped_prompts_splice_every_document_whole(tokenizer, docs):
    """With "\\n\\n" between documents that end on a word, every document token is spliced."""
    tokenizing, registry = _engine_side(tokenizer)
    records = [_record(tokenizing, doc) for doc in docs]
    for record in records:
        registry.register(record)
    text = "You answer from the documents.\n\n" + "\n\n".join(reversed(docs)) + "\n\nQuestion: which one?\nAnswer:"
    spliced = splice_tokens(text, _known(tokenizing, registry.find(text)), splice_support(tokenizer)[0])
    assert (spliced.ids.tolist(), [tuple(s) for s in spliced.spans.tolist()]) == _whole(tokenizer, text)
    merged = sum(1 for doc in docs if not doc[-1].isalnum())  # a last "." may join the newlines after it
    assert spliced.stored >= sum(len(r.token_ids) for r in records) - merged


def test_a_record_whose_tokens_are_not_its_texts_is_not_spliced(tokenizer, docs):
    """A record read from a shared store is checked once against its text before its tokens
    stand in for it: a tampered one is tokenized instead, and the prompt stays exact."""
    tokenizing, registry = _engine_side(tokenizer)
    honest = make_record(docs[0], *tokenizing.ids_with_offsets(docs[0]), "fp", 16)
    ids = list(honest.token_ids)
    ids[3] = (ids[3] + 1) % 500
    registry.register(replace(honest, token_ids=tuple(ids)))
    text = "Read this:\n\n" + docs[0] + "\n\nDone."
    tokens = tokenizing.prompt(text, find=True)
    assert (tokens.ids, tokens.offsets) == _whole(tokenizer, text)
    assert tokenizing.checked.word_starts(replace(honest, token_ids=tuple(ids))) is None
    assert tokenizing.prompt(text, find=True).ids == tokens.ids


def test_an_unchecked_record_is_checked_once_then_trusted(tokenizer, docs):
    tokenizing, registry = _engine_side(tokenizer)
    record = make_record(docs[1], *tokenizing.ids_with_offsets(docs[1]), "fp", 16)  # as read from a store
    registry.register(record)
    assert tokenizing.checked.word_starts(record) is None
    text = "Read this:\n\n" + docs[1] + "\n\nDone."
    assert tokenizing.prompt(text, find=True).ids == _whole(tokenizer, text)[0]
    assert tokenizing.checked.word_starts(record)


def test_a_leading_part_of_a_document_is_tokenized_not_spliced(tokenizer, docs):
    tokenizing, registry = _engine_side(tokenizer)
    registry.register(_record(tokenizing, docs[2]))
    part = docs[2][: len(docs[2]) // 2]
    text = "Part:\n\n" + part + "\n\nEnd."
    tokens = tokenizing.prompt(text, find=True)
    assert [o.is_whole for o in tokens.found] == [False]
    assert (tokens.ids, tokens.offsets) == _whole(tokenizer, text)


def test_a_document_that_merges_with_its_neighbours_gives_up_only_its_edges(tokenizer):
    """Words run across the joints: their tokens come from the gaps, the rest is spliced."""
    tokenizing, registry = _engine_side(tokenizer)
    doc = "tion of the standard library gained a new module for its own"
    record = _record(tokenizing, doc)
    registry.register(record)
    text = "The func" + doc + "ership and more text after it."
    spliced = splice_tokens(text, _known(tokenizing, registry.find(text)), splice_support(tokenizer)[0])
    assert (spliced.ids.tolist(), [tuple(s) for s in spliced.spans.tolist()]) == _whole(tokenizer, text)
    assert 0 < spliced.stored < len(record.token_ids)


def test_tokenizers_without_splice_support_are_named():
    support, reason = splice_support(trained("no-pre-tokenizer"))
    assert support is None and "pre-tokenizer" in reason
