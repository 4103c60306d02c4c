"""The blocks of a prompt's text: the documents a plain prompt holds without naming them.

Stuff-documents prompts (LangChain's, LlamaIndex's, most hand-written RAG templates) join the
retrieved documents with a blank line, or set them off with a line of dashes; the chat
template then wraps the messages in its special tokens. :func:`prompt_blocks` cuts a prompt
on those boundaries and returns the pieces long enough to be worth storing. The engine stores
each as a document, by content, so the next prompt that holds it, at any place and in any
order, finds it as it finds a warmed or named document (``store_prompt_blocks``).

What is never a block: the prompt's opening (its first piece with text: the system prompt,
which exact prefix reuse serves), the closing question (the last piece when only a
generation prompt follows it), the text after the prompt's last cut, pieces shorter than
:data:`MIN_BLOCK_CHARS`, a message's role marker, and any piece holding a special token.

Pure: standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

#: Fewest characters (whitespace around a block not counted) a block has to be stored.
MIN_BLOCK_CHARS = 64
#: Longest first line after a special token that is read as a role marker (``user``).
ROLE_CHARS = 24

#: A closing piece followed by fewer characters than this (besides special tokens and
#: whitespace: a generation prompt such as ``assistant``) is the prompt's question, no block.
CLOSING_CHARS = 24

#: A blank line, or a line of only three or more ``-=*_#~`` (a separator line).
_LINE_BOUNDARY = r"\n[ \t\r]*\n|\n[ \t]*[-=*_#~]{3,}[ \t\r]*(?=\n)"


#: A block's closing punctuation, left out of it: many tokenizers merge it with the newlines
#: after it (``".\n\n"`` is one token to Qwen's and Llama 3's), so the block's last token
#: would differ in the prompt and its last chunk could not be cut from the prompt's K/V.
_TRAILING_MARKS = re.compile(r"[^\w\s]+$")
_SPACE = re.compile(r"\s+")
_ROLE_ONLY = re.compile(r"\s*[^\s]{1,%d}\s*" % ROLE_CHARS)
_ROLE_LINE = re.compile(r"[ \t]*[^\s]{1,%d}[ \t]*\n" % ROLE_CHARS)


def _boundary_pattern(special_tokens: Sequence[str]) -> re.Pattern[str]:
    """Blank lines, separator lines and (longest first) the special tokens' texts."""
    specials = sorted({token for token in special_tokens if token}, key=len, reverse=True)
    return re.compile("|".join([_LINE_BOUNDARY, *(re.escape(token) for token in specials)]))


class PromptBlock(NamedTuple):
    """A block of a prompt: where it starts in the prompt's text, and its text."""

    start: int
    text: str

    @property
    def end(self) -> int:
        """Where it ends in the prompt's text."""
        return self.start + len(self.text)


def prompt_blocks(text: str, special_tokens: Sequence[str] = (), min_chars: int = MIN_BLOCK_CHARS) -> list[PromptBlock]:
    """The blocks of ``text`` worth storing as documents, in order, each text once.

    The text is cut at blank lines, separator lines and special tokens. A piece after a
    special token loses its first line when that line is a role marker (``user``,
    ``assistant``: at most :data:`ROLE_CHARS` characters, no space). The first piece with text
    (the prompt's opening) is no block, nor is the text after the last cut, nor the last
    piece when nothing but a generation prompt follows it (fewer than :data:`CLOSING_CHARS`
    characters besides special tokens and whitespace: the closing question). The others of at
    least ``min_chars`` characters are blocks.

    Args:
        text: The prompt, as the model reads it (chat template applied).
        special_tokens: The tokenizer's special tokens' texts (``<|im_start|>``, ...): they
            end a block too.
        min_chars: Fewest characters a block has, its surrounding whitespace not counted.

    Returns:
        Each block where it stands in ``text``, stripped of surrounding whitespace (but the
        space before an indented first word) and closing punctuation, so it starts and ends
        where the prompt's tokens do; a text seen before in the prompt is left out.
    """
    pattern = _boundary_pattern(special_tokens)
    long = _long(_pieces(text, pattern), text, min_chars)
    if long and len(_SPACE.sub("", pattern.sub("", text[long[-1][1] :]))) < CLOSING_CHARS:
        long.pop()  # the prompt's closing question: only a generation prompt follows it
    blocks: list[PromptBlock] = []
    seen: set[str] = set()
    for start, end in long:
        start, end = _trimmed(text, start, end)
        block = PromptBlock(start, text[start:end])
        if block.text.strip() and block.text not in seen:
            seen.add(block.text)
            blocks.append(block)
    return blocks


def _pieces(text: str, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of each piece between two cuts, the prompt's opening (its first piece
    with text) left out, a role marker line left out of a piece."""
    pieces: list[tuple[int, int]] = []
    start, after_special, opened = 0, False, False
    for match in pattern.finditer(text):
        if after_special:
            role = _ROLE_LINE.match(text, start, match.start())
            start = role.end() if role else start
        body = text[start : match.start()]
        if after_special and _ROLE_ONLY.fullmatch(body):
            body = ""  # a role marker between two special tokens, or before a blank line
        if opened:
            pieces.append((start, match.start()))
        opened = opened or bool(body.strip())
        after_special, start = not match.group(0).startswith("\n"), match.end()
    return pieces


def _long(pieces: list[tuple[int, int]], text: str, min_chars: int) -> list[tuple[int, int]]:
    """Spans of the pieces of at least ``min_chars`` characters. Shorter pieces (a heading, a
    label) are left to be computed: glued onto their neighbour they would tie it to whatever
    came before it in this prompt (the last document, a template's label), and such a block
    would be new, and stored, in every prompt."""
    return [(start, end) for start, end in pieces if len(text[start:end].strip()) >= min_chars]


def _trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    """The span of the piece ``text[start:end]`` without its surrounding whitespace (but for
    the space before an indented first word: byte-level tokenizers (GPT-2's, Qwen's, Llama
    3's) read ``"   if"`` as ``"  "`` and ``" if"``, so a block that starts at ``" if"``
    tokenizes alone as it does in the prompt) and without its closing punctuation."""
    body = text[start:end].rstrip()
    end = start + len(body)
    lead = len(body) - len(body.lstrip("\r\n"))
    rest = body[lead:]
    indent = len(rest) - len(rest.lstrip(" \t"))
    start += lead + (indent - 1 if indent and rest[indent - 1] == " " else indent)
    marks = _TRAILING_MARKS.search(text, start, end)
    return start, marks.start() if marks else end
