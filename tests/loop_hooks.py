"""Hooks into an engine's loop for tests: what each step decoded, failures put into a step."""

from __future__ import annotations

from collections.abc import Callable

from kvboost_rag import KVBoost
from kvboost_rag.decode.step import DecodeRows
from kvboost_rag.dev.threads import loop_held  # noqa: F401 - the tests' one import of the hooks


def on_decode_rows(engine: KVBoost, hook: Callable[[DecodeRows], None]) -> None:
    """Call ``hook`` with every step's decode rows before the loop hands them their logits."""
    loop = engine._loop
    real = loop._finish_rows

    def finish(rows: DecodeRows, outputs: list) -> None:
        hook(rows)
        real(rows, outputs)

    loop._finish_rows = finish


def record_decode_sizes(engine: KVBoost) -> list[int]:
    """How many sequences each step of ``engine`` decodes, from now on."""
    sizes: list[int] = []
    on_decode_rows(engine, lambda rows: sizes.append(len(rows.sequences)))
    return sizes

