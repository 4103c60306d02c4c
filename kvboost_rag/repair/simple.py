"""The two strategies that run no selection pass: document starts, and no repair."""

from __future__ import annotations

from kvboost_rag.hf.passes import PassSteps
from kvboost_rag.repair.base import RepairInputs, Selection
from kvboost_rag.repair.runs import contiguous_runs
from kvboost_rag.repair.selection import select_document_starts


class SelectiveRepair:
    """Recomputes the first tokens of each document (just after each seam)."""

    name = "selective"

    def choose(self, inputs: RepairInputs) -> PassSteps[Selection]:
        """The leading tokens of each run of cached positions, within the budget (no pass)."""
        return Selection(select_document_starts(contiguous_runs(inputs.content_positions), inputs.budget))
        yield  # a generator that runs no pass


class NoRepair:
    """Recomputes nothing: documents are used as loaded (re-rotated only)."""

    name = "none"

    def choose(self, inputs: RepairInputs) -> PassSteps[Selection]:
        """No tokens (no pass)."""
        return Selection(inputs.content_positions[:0])
        yield  # a generator that runs no pass
