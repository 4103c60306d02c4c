"""A plain prompt's documents, never named or warmed, are found by content next time: the
blocks of its text (blank lines, separator lines, special tokens) are stored as documents."""

from __future__ import annotations

import logging

import torch

import kvboost_rag.generation.completion as completion
from kvboost_rag.log_limits import RateLimitedLogger
from kvboost_rag.request.blocks import MIN_BLOCK_CHARS, prompt_blocks

SYSTEM = "You are a careful assistant. Answer only from the documents below."
DOCS = [
    "The river carries boats past the old mill and the bridge near the northern town, where the "
    "ferrymen wait each morning for the grain barges to come down from the upland farms.",
    "Quiet meadows stretch beyond the hills where shepherds rest their flocks at noon, and the "
    "stone walls that divide them were built by hand over three centuries of patient work.",
    "Lanterns were lit along the harbour wall every evening before the fishing fleet returned, "
    "so the boats could find the narrow channel between the rocks even in the winter fog.",
    "The library on the square lends maps of the coast, tide tables for every month of the year, "
    "and a ledger in which the lighthouse keepers wrote down each ship that passed the point.",
]


def chat(docs: list[str], question: str) -> str:
    """A chat-rendered RAG prompt: documents in the system message, joined by blank lines."""
    system = SYSTEM + "\n\n" + "\n\n".join(docs)
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def block_texts(text: str, special_tokens: tuple[str, ...] = ()) -> list[str]:
    """The blocks' texts, each checked to stand in ``text`` where its span says."""
    blocks = prompt_blocks(text, special_tokens)
    assert all(text[block.start : block.end] == block.text for block in blocks)
    return [block.text for block in blocks]


def test_blocks_are_the_documents_between_the_opening_and_the_end() -> None:
    blocks = block_texts(chat(DOCS[:3], "Where do the boats wait?"), SPECIALS)
    # the last document ends at a special token, not a blank line; closing marks are left out
    assert blocks == [d.removesuffix(".") for d in DOCS[:3]]


def test_a_document_right_after_a_role_marker_is_a_block_and_the_system_prompt_is_not() -> None:
    """Documents in the user message, the first one right after its role marker."""
    user = "\n\n".join(DOCS[:2]) + "\n\nQuestion: where do the boats wait?"
    system = "You are a careful assistant who answers from the documents in the user's message only."
    text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert len(system) >= MIN_BLOCK_CHARS
    assert block_texts(text, SPECIALS) == [DOCS[0][:-1], DOCS[1][:-1]]


def test_the_opening_the_end_short_pieces_and_repeats_are_no_blocks() -> None:
    long_opening = "An opening paragraph long enough to be a block if it were not the opening. " * 3
    question = "A question long enough to be a block if it were not at the end of the prompt. " * 3
    text = long_opening + "\n\n" + DOCS[0] + "\n\n" + DOCS[0] + "\n\nA heading\n*********\n\n" + DOCS[1] + "\n\n" + question
    assert block_texts(text) == [DOCS[0][:-1], DOCS[1][:-1]]


def test_separator_lines_end_blocks_and_blocks_are_stripped() -> None:
    text = "Context information is below.\n---------------------\n  " + DOCS[1] + "  \n\n" + DOCS[2]
    text += "\n---------------------\nGiven the context, answer the query.\nQuery: where?\nAnswer: "
    # the space before an indented first word stays (see the indented block's test)
    assert block_texts(text) == [" " + DOCS[1][:-1], DOCS[2][:-1]]


def test_a_block_is_where_it_stands_even_when_the_opening_quotes_it(make_engine) -> None:
    """The opening holds the block's text too: the block is the later piece, and the engine
    places its record there, not at the text's first occurrence."""
    text = "Notes to read first: " + DOCS[0] + "\n\n" + DOCS[0] + "\n\nQuestion: where do the boats wait?"
    (block,) = prompt_blocks(text)
    assert block.start == text.index("\n\n") + 2 and block.text == DOCS[0][:-1]
    engine = make_engine("llama")
    tokenizing = engine._tokenizing
    _, (occurrence,) = tokenizing.new_blocks(text, [], engine._cache.index.known_documents(), engine.fingerprint, engine.settings.chunk_size)
    assert occurrence.char_start == block.start


def test_min_chars_is_counted_without_the_surrounding_whitespace() -> None:
    block, end = "x" * (MIN_BLOCK_CHARS - 1), "Question: what does the block say?"
    assert block_texts(f"opening\n\n   {block}   \n\n{end}") == []
    assert block_texts(f"opening\n\n{block}y\n\n{end}") == [block + "y"]
    assert block_texts(f"opening\n\n{block}y).\n\n{end}") == [block + "y"]  # closing marks left out


def test_the_closing_question_of_a_chat_prompt_is_no_block() -> None:
    """Documents and a long question in the last user message, set off by separator lines:
    the question is followed by nothing but the generation prompt."""
    question = "Given the context information and not prior knowledge, answer the query in one short sentence, quoting the document it comes from. Query: where?"
    user = "Context information is below.\n-----\n" + DOCS[0] + "\n\n" + DOCS[1] + "\n-----\n" + question
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert len(question) >= MIN_BLOCK_CHARS
    assert block_texts(text, SPECIALS) == [DOCS[0][:-1], DOCS[1][:-1]]


def test_a_plain_prompts_documents_are_found_in_another_order_next_time(make_engine) -> None:
    engine = make_engine("llama")
    engine.generate(chat(DOCS[:3], "Where do the boats wait?"), max_new_tokens=2)

    again = engine.generate(chat([DOCS[2], DOCS[0], DOCS[1]], "What lights the wall?"), max_new_tokens=2)

    assert again.documents_found == 3
    doc_tokens = sum(engine.count_tokens(d) for d in DOCS[:3])
    assert again.content_hit_tokens >= doc_tokens - 3 * 4  # all but boundary merges


def test_a_block_that_opens_as_a_stored_one_does_is_stored_and_found_whole_next_time(make_engine) -> None:
    """A block whose first sentence a stored block shares (the stored one is found at its
    start, matched only there) is stored all the same, and read from cache whole next time."""
    engine = make_engine("llama")
    opening = "The following methods can be defined to change what the objects of a class do. "
    first, second = opening + DOCS[0], opening + DOCS[1]
    engine.generate(chat([DOCS[3], first], "Where do the boats wait?"), max_new_tokens=1)
    engine.generate(chat([DOCS[3], second], "Where do the flocks rest?"), max_new_tokens=1)

    again = engine.generate(chat([DOCS[2], second], "What do the meadows hold?"), max_new_tokens=1)

    assert again.documents_found == 1  # DOCS[2] is new here
    assert again.content_hit_tokens >= engine.count_tokens(second) - 2 * 4  # all but boundary merges


def test_with_blocks_off_a_plain_prompt_stores_no_document(make_engine) -> None:
    engine = make_engine("llama", store_prompt_blocks=False)
    engine.generate(chat(DOCS[:3], "Where do the boats wait?"), max_new_tokens=2)

    again = engine.generate(chat([DOCS[2], DOCS[0], DOCS[1]], "What lights the wall?"), max_new_tokens=2)

    assert again.documents_found == 0 and again.content_hit_tokens == 0
    assert engine.cache_stats().documents == 0


def test_the_same_plain_prompt_again_hits_whole_and_exactly(make_engine) -> None:
    engine = make_engine("llama")
    prompt = chat(DOCS[:3], "Where do the boats wait?")
    engine.generate(prompt, max_new_tokens=1)

    again = engine.generate(prompt, max_new_tokens=1, return_logits=True)
    full = engine.generate(prompt, max_new_tokens=1, return_logits=True, reuse=False)

    assert again.prefix_hit_tokens == again.prompt_tokens - 1
    assert again.content_hit_tokens == 0 and again.recomputed_tokens == 0
    torch.testing.assert_close(again.first_token_logits, full.first_token_logits, rtol=1e-4, atol=1e-4)


def test_a_conversation_going_on_hits_each_earlier_turn_whole(make_engine) -> None:
    """Turn 2 finds turn 1's blocks as known documents; as its prefix hit passed them all, it
    is stored whole too, so turn 3 hits all of turn 2 (not only turn 1)."""
    engine = make_engine("llama", chunk_size=16)
    turn1 = chat(DOCS[:3], "Where do the boats wait?")
    turn2 = turn1 + "By the mill.<|im_end|>\n<|im_start|>user\nAnd the maps?<|im_end|>\n<|im_start|>assistant\n"
    turn3 = turn2 + "In the library.<|im_end|>\n<|im_start|>user\nWho wrote the ledger?<|im_end|>\n<|im_start|>assistant\n"
    engine.generate(turn1, max_new_tokens=1)
    second = engine.generate(turn2, max_new_tokens=1)
    third = engine.generate(turn3, max_new_tokens=1)

    assert second.prefix_hit_tokens >= engine.count_tokens(turn1) - 16
    assert third.prefix_hit_tokens >= engine.count_tokens(turn2) - 16
    assert third.content_hit_tokens == 0 and third.recomputed_tokens == 0


def test_a_prompt_of_new_blocks_is_not_reported_as_missing_stored_documents(make_engine, caplog, monkeypatch) -> None:
    """Blocks stored from one prompt are not "prewarmed documents" the next prompt of other,
    new documents missed: no warning (its own blocks are stored in turn)."""
    monkeypatch.setattr(completion, "_warnings", RateLimitedLogger(completion.logger))  # not limited by earlier tests
    engine = make_engine("llama")
    engine.generate(chat(DOCS[:2], "Where do the boats wait?"), max_new_tokens=1)
    with caplog.at_level(logging.WARNING, logger="kvboost_rag"):
        engine.generate(chat(DOCS[2:], "What does the library lend?"), max_new_tokens=1)
    assert not [r for r in caplog.records if "none was found" in r.getMessage()]
    assert engine.cache_stats().documents == 4


def test_an_indented_block_keeps_the_space_its_first_word_is_read_with() -> None:
    code = "   if __debug__:\n       if not expression: raise AssertionError(expression, 'a message text')"
    text = "opening\n\n" + code + "\n\nQuestion: what does the assert statement do, in one sentence?"
    assert block_texts(text) == [" if __debug__:\n       if not expression: raise AssertionError(expression, 'a message text"]


def test_a_role_marker_alone_before_a_blank_line_is_not_the_opening() -> None:
    """LlamaIndex's chat engines start the system message with a newline: the role marker then
    stands alone before a blank line, and the system prompt after it is still the opening."""
    system = "\n  The following is a friendly conversation between a user and an AI assistant, who answers in detail."
    text = f"<|im_start|>system\n{system}\n\n{DOCS[0]}<|im_end|>\n<|im_start|>user\nWhere do the boats wait?<|im_end|>\n<|im_start|>assistant\n"
    assert block_texts(text, SPECIALS) == [DOCS[0][:-1]]
