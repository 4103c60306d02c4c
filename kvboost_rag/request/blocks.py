"""The blocks of a prompt's text: the documents a plain prompt holds without naming them.

Stuff-documents prompts (LangChain's, LlamaIndex's, most hand-written RAG templates) join the
retrieved documents with a blank line, or set them off with a line of dashes; the chat
template then wraps the messages in its special tokens. :func:`prompt_blocks` cuts a prompt
on those boundaries and returns the pieces long enough to be worth storing. The engine stores
each as a document, by content, so the next prompt that holds it, at any place and in any
order, finds it as it finds a warmed or named document (``store_prompt_blocks``).

What is never a block: a piece that does not follow a blank or separator line (the prompt's
opening, the template's start and the system prompt, which exact prefix reuse serves; the
start of a message after its role marker), the closing question (the last piece when only a
generation prompt follows it), the text after the prompt's last boundary, pieces shorter than
:data:`MIN_BLOCK_CHARS`, and any piece holding a special token.

Pure: standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

#: Fewest characters (whitespace around a block not counted) a block has to be stored.
MIN_BLOCK_CHARS = 128

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


def _boundary_pattern(special_tokens: Sequence[str]) -> re.Pattern[str]:
    """Blank lines, separator lines and (longest first) the special tokens' texts."""
    specials = sorted({token for token in special_tokens if token}, key=len, reverse=True)
    return re.compile("|".join([_LINE_BOUNDARY, *(re.escape(token) for token in specials)]))


def prompt_blocks(text: str, special_tokens: Sequence[str] = (), min_chars: int = MIN_BLOCK_CHARS) -> list[str]:
    """The blocks of ``text`` worth storing as documents, in order, each once.

    A block is a piece right after a blank or separator line that ends at the next boundary
    (a blank or separator line, or a special token), of at least ``min_chars`` characters.
    The last such piece is left out when nothing but a generation prompt follows it (fewer
    than :data:`CLOSING_CHARS` characters besides special tokens and whitespace): it is the
    closing question or instruction, new in every prompt.

    Args:
        text: The prompt, as the model reads it (chat template applied).
        special_tokens: The tokenizer's special tokens' texts (``<|im_start|>``, ...): they
            end a block too.
        min_chars: Fewest characters a block has, its surrounding whitespace not counted.

    Returns:
        Each block's text, stripped of surrounding whitespace and closing punctuation (so it
        is found in the prompt as it stands there, and ends where the prompt's tokens do).
    """
    pattern = _boundary_pattern(special_tokens)
    pieces: list[tuple[str, int]] = []  # (text, where it ends) of the pieces after a line boundary
    start, after_line = 0, False
    for match in pattern.finditer(text):
        if after_line:
            pieces.append((text[start : match.start()], match.start()))
        after_line, start = match.group(0).startswith("\n"), match.end()
    long = [(piece.strip(), end) for piece, end in pieces if len(piece.strip()) >= min_chars]
    if long and len(_SPACE.sub("", pattern.sub("", text[long[-1][1] :]))) < CLOSING_CHARS:
        long.pop()  # the prompt's closing question: only a generation prompt follows it
    blocks: list[str] = []
    for piece, _ in long:
        block = _TRAILING_MARKS.sub("", piece)
        if block and block not in blocks:
            blocks.append(block)
    return blocks
