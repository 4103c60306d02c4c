"""What warming some documents did: one counts type for every warm path.

A prewarm run of an integration (``KVBoostPrewarmer``), one batch of a warm job and a warm
job's totals all count with :class:`WarmCounts`; the job's batch and report types extend it
with who ran it and how fast (:mod:`kvboost_rag.warm_job.report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class DocumentFailure:
    """A document that could not be warmed.

    Attributes:
        doc_id: The document's id in its source (or its label in a prewarm run).
        error: Why: the exception's type and message, or ``"oversized: ..."``.
    """

    doc_id: str
    error: str


class WarmCounts(BaseModel):
    """What warming some documents did.

    Attributes:
        documents: Documents received.
        computed: Distinct documents whose K/V was computed and stored.
        skipped: Documents stored already (by an earlier run, another process or worker): only
            their records were read.
        duplicates: Documents whose text repeated an earlier one of the same run.
        empty: Documents with no text (skipped).
        oversized: Documents too long for the model behind the warm prefix, or than a run's
            limit (skipped; named in :attr:`failures`).
        failed: Documents the engine refused for another reason (named in :attr:`failures`).
        tokens: Tokens of the documents computed or skipped.
        computed_tokens: Tokens whose K/V was computed.
        bytes_written: Bytes written to the shared tiers (Redis counts exactly; a disk folder
            by the growth of its usage).
        seconds: Wall time.
        failures: Each document not warmed and why.
        results: The engine's ``WarmResult`` of each text handed to it, in order (prewarm runs).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=False)

    documents: int = 0
    computed: int = 0
    skipped: int = 0
    duplicates: int = 0
    empty: int = 0
    oversized: int = 0
    failed: int = 0
    tokens: int = 0
    computed_tokens: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    failures: list[DocumentFailure] = Field(default_factory=list)
    results: list[Any] = Field(default_factory=list)

    @property
    def warmed(self) -> int:
        """Documents computed (:attr:`computed`, as a prewarm run names it)."""
        return self.computed

    @property
    def already_warm(self) -> int:
        """Documents stored already (:attr:`skipped`, as a prewarm run names it)."""
        return self.skipped

    @property
    def new_tokens(self) -> int:
        """Tokens computed (:attr:`computed_tokens`)."""
        return self.computed_tokens

    @property
    def elapsed_ms(self) -> float:
        """Wall time in milliseconds."""
        return self.seconds * 1000.0

    def add(self, other: WarmCounts) -> None:
        """Count ``other``'s documents, tokens, bytes and failures in (not its time)."""
        for name in ("computed", "skipped", "duplicates", "empty", "oversized", "failed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.tokens += other.tokens
        self.computed_tokens += other.computed_tokens
        self.bytes_written += other.bytes_written
        self.failures.extend(other.failures)
        self.results.extend(other.results)

    def summary(self) -> str:
        """One line with every count."""
        return (
            f"{self.documents} documents, {self.computed} warmed ({self.computed_tokens} tokens), "
            f"{self.skipped} already warm, {self.duplicates} repeated, {self.empty} empty, "
            f"{self.oversized} oversized, {self.failed} failed in {self.elapsed_ms:.0f} ms"
        )
