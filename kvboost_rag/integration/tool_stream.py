"""Streaming a reply that may be a tool call: text is shown as it decodes, a call is held back.

Under a tool constraint plain text never starts with ``<`` (see :mod:`kvboost_rag.decode.tool_calls`),
so a reply whose first piece starts with ``<`` is a tool call: its pieces are held back and
read as calls once the stream has ended, so a framework never shows ``<tool_call>`` text as
content.
"""

from __future__ import annotations

from kvboost_rag.decode.tool_calls import CallFormat, ParsedOutput, parse_tool_calls


class ToolCallHoldBack:
    """Decides, piece by piece, what a streamed reply shows and what it holds back.

    Args:
        call_format: The call's format; only a format that parses tool calls holds anything.

    Example:
        .. code-block:: python

            hold = ToolCallHoldBack(call_format)
            for piece in engine.stream(prompt, constraint=call_format.constraint):
                shown = hold.feed(piece)
                if shown is not None:
                    send_text(shown)
            parsed = hold.finish(stream.result.finish_reason)
            if parsed is not None:
                send_tool_calls(parsed)
    """

    def __init__(self, call_format: CallFormat) -> None:
        self._parses = call_format.parses_tool_calls
        self._decided = False
        self._holding = False
        self._held: list[str] = []
        self._shown: list[str] = []

    @property
    def holding(self) -> bool:
        """Whether the reply is a tool call being held back."""
        return self._holding

    @property
    def shown_text(self) -> str:
        """The text shown so far."""
        return "".join(self._shown)

    @property
    def held_text(self) -> str:
        """The text held back so far."""
        return "".join(self._held)

    def feed(self, piece: str) -> str | None:
        """Take the next streamed piece.

        Args:
            piece: Newly decoded text.

        Returns:
            The piece to show now, or ``None`` when it is held back.
        """
        if not self._decided and piece:
            self._decided = True
            self._holding = self._parses and piece.startswith("<")
        if self._holding:
            self._held.append(piece)
            return None
        self._shown.append(piece)
        return piece

    def finish(self, finish_reason: str | None = None) -> ParsedOutput | None:
        """The tool calls of the held-back text, once the stream has ended.

        Args:
            finish_reason: The result's finish reason (a call cut by ``max_new_tokens`` is
                reported as such).

        Returns:
            The parsed output, or ``None`` when nothing was held back.
        """
        if not self._holding:
            return None
        return parse_tool_calls(self.held_text, finish_reason)
