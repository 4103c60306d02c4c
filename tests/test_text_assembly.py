"""Text assembly of generated tokens: the same text as decoding all of them, in linear work."""

from __future__ import annotations

from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.decode.sampling import TextAssembler


class CountingTokenizer:
    """Wraps a tokenizer and counts the tokens it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_pieces_join_to_the_full_decode_in_linear_work(tokenizer):
    text = " ".join(python_reference_documents(max_chars=2000)[:3]) + " héllo ✓ 日本語 🙂"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    counting = CountingTokenizer(tokenizer)
    assembler = TextAssembler(counting)
    pieces = "".join(assembler.add(i) for i in ids) + assembler.finish()
    assert pieces == tokenizer.decode(ids, skip_special_tokens=True) == assembler.text
    assert len(ids) > 500
    assert counting.decoded <= 6 * len(ids), f"{counting.decoded} tokens decoded for {len(ids)} generated"


def test_stop_string_across_pieces_cuts_the_text(tokenizer):
    ids = tokenizer("first answer END and more text after it", add_special_tokens=False)["input_ids"]
    assembler = TextAssembler(tokenizer, stop=["END"])
    pieces = ""
    for token in ids:
        pieces += assembler.add(token)
        if assembler.stopped:
            break
    pieces += assembler.finish()
    assert assembler.stopped and pieces == assembler.text == "first answer "
    assert tokenizer.decode(assembler.trimmed_token_ids()).startswith("first answer")
