"""The shortest way to finish a constrained output: what lets every output close within its budget.

A :class:`ClosingPlanner` finds, from a matcher's current state, a short token sequence that
completes the grammar (a *closing path*): for a tool call cut inside its first string argument,
``", "section": ""}}\\n</tool_call>``. :class:`~kvboost_rag.decode.constrained.GrammarGuide` keeps the
path of its current state and refuses a token after which the path no longer fits the tokens
left, so an output that starts within budget always ends valid; the path of the first state is
the constraint's minimum budget.

The path is found on bytes, then tokenized: the bytes llguidance forces come first (keys,
separators, constant names), and at each choice point the first allowed byte of a short
preference list (``"`` ends a string, ``}`` and ``]`` end objects and arrays, ``0`` is the
shortest number, a newline ends a line of free text), a newline first where it ends a line
(after it the output may end or the grammar forces what follows; in free text ``"`` is one
more character); at the first choice point the two best allowed bytes are both tried
and the shorter finish kept, so a ``}`` after ``{`` beats opening an optional key. A choice
point where no preferred byte is allowed takes the lowest allowed printable ASCII byte (a
letter a pattern needs; the first choice point compares the two lowest). The path is a valid
finish, short but not always the shortest one; the guarantee rests only on its validity. A
grammar where this walk finds no finish within its limits (a pattern it cannot satisfy byte by
byte, a ``minLength`` of hundreds) has no known path: it decodes as before, without closing.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

#: Bytes tried at a choice point, best first: end a string, an object, an array; the shortest
#: number; end an item; end a line (free text that a newline ends).
PREFERRED_BYTES = b'"}]0,\n'

NEWLINE = 10

#: Longest closing path searched, in bytes.
MAX_CLOSING_BYTES = 4096

#: Most bytes of a closing path that are choices (not forced by the grammar): free values
#: and what ``minLength`` asks for.
MAX_CLOSING_CHOICES = 512


class ClosingPlanner:
    """Finds closing paths for matchers over one tokenizer.

    Args:
        tokenizer: The ``llguidance.LLTokenizer`` the matchers use.
        max_bytes: Longest path searched; longer finishes count as unknown.
        max_choices: Most chosen (not forced) bytes in a path; more count as unknown.
    """

    def __init__(
        self, tokenizer: Any, max_bytes: int = MAX_CLOSING_BYTES, max_choices: int = MAX_CLOSING_CHOICES
    ) -> None:
        self._tokenizer = tokenizer
        self._max_bytes = max_bytes
        self._max_choices = max_choices
        self._byte_token: dict[int, int] = {}
        for byte in [NEWLINE, *range(32, 127)]:
            tokens = tokenizer.tokenize_bytes(bytes([byte]))
            if len(tokens) == 1:
                self._byte_token[byte] = tokens[0]
        self._preferred = [b for b in PREFERRED_BYTES if b in self._byte_token]
        self._ascending = sorted(set(self._byte_token) - {NEWLINE})

    def path(self, matcher: Any) -> list[int] | None:
        """Tokens that complete ``matcher``'s grammar from its current state (``[]`` when it
        may end here), or ``None`` when no finish was found. The matcher is left as it was.
        """
        found = self._walk(matcher, compare=True)
        if found is None:
            return None
        if not found:
            return []
        tokens = self._tokenizer.tokenize_bytes(bytes(found))
        if matcher.validate_tokens(tokens) == len(tokens):
            return tokens
        # The tokenizer's split of the whole finish is not one the grammar allows (a token
        # across a lexeme boundary it forbids): the byte tokens are.
        return [self._byte_token[b] for b in found] if all(b in self._byte_token for b in found) else None

    def _walk(self, matcher: Any, compare: bool) -> list[int] | None:
        """Bytes of a finish, consuming and then rolling back; ``compare`` tries the two
        best allowed bytes at the first choice point."""
        path: list[int] = []
        consumed = 0
        choices = 0
        try:
            while not matcher.is_accepting():
                forced = matcher.compute_ff_bytes()
                if forced:
                    if len(path) + len(forced) > self._max_bytes:
                        return None
                    tokens = self._tokenizer.tokenize_bytes(forced)
                    taken = matcher.try_consume_tokens(tokens)
                    if taken == 0:
                        return None
                    consumed += taken
                    path.extend(self._tokenizer.decode_bytes(tokens[:taken]))
                    continue
                choices += 1
                if choices > self._max_choices or len(path) >= self._max_bytes:
                    return None
                allowed = self._ranked(matcher, self._allowed_bytes(matcher))
                if not allowed:
                    return None
                if compare and len(allowed) > 1:
                    rest = self._shortest_after(matcher, allowed[:2])
                    return None if rest is None else path + rest
                matcher.consume_token(self._byte_token[allowed[0]])
                consumed += 1
                path.append(allowed[0])
            return path
        finally:
            if consumed:
                matcher.rollback(consumed)

    def _shortest_after(self, matcher: Any, choices: list[int]) -> list[int] | None:
        best: list[int] | None = None
        for byte in choices:
            matcher.consume_token(self._byte_token[byte])
            try:
                rest = self._walk(matcher, compare=False)
            finally:
                matcher.rollback(1)
            if rest is not None and (best is None or len(rest) + 1 < len(best)):
                best = [byte, *rest]
        return best

    def _ranked(self, matcher: Any, allowed: list[int]) -> list[int]:
        """``allowed``, with a newline first when it ends a line of free text (after it the
        output may end or the grammar forces what comes next): there ``"`` and the other
        preferred bytes are one more character each. Only a newline is probed: JSON without
        free whitespace never allows one, and probing every byte of a free JSON value can
        exhaust the matcher's per-step budget."""
        if NEWLINE not in allowed or allowed[0] == NEWLINE:
            return allowed
        matcher.consume_token(self._byte_token[NEWLINE])
        try:
            ends_line = matcher.is_accepting() or bool(matcher.compute_ff_bytes())
        finally:
            matcher.rollback(1)
        return [NEWLINE, *[b for b in allowed if b != NEWLINE]] if ends_line else allowed

    def _allowed_bytes(self, matcher: Any) -> list[int]:
        """The preferred bytes the grammar allows next, best first; else the two lowest
        allowed printable ASCII bytes; else none."""
        mask = matcher.compute_bitmask()

        def allows(byte: int) -> bool:
            token = self._byte_token[byte]
            return bool(mask[token // 8] >> (token % 8) & 1)

        preferred = [b for b in self._preferred if allows(b)]
        if preferred:
            return preferred
        lowest: list[int] = []
        for byte in self._ascending:
            if allows(byte):
                lowest.append(byte)
                if len(lowest) == 2:
                    break
        return lowest
