"""What a warm job did: per-batch outcomes and the job's totals and rates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class DocumentFailure:
    """A document the job could not warm.

    Attributes:
        doc_id: The document's id in its source.
        error: The exception's type and message.
    """

    doc_id: str
    error: str


@dataclass
class BatchOutcome:
    """What one worker did with one batch.

    Attributes:
        computed: Documents whose K/V this batch computed and stored.
        skipped: Documents stored already (by an earlier run or another worker): only their
            records were read.
        tokens: Tokens of the documents warmed or skipped.
        computed_tokens: Tokens whose K/V this batch computed.
        bytes_written: Bytes the worker's shared tiers received for this batch.
        failures: Documents that raised.
        seconds: Wall time of the batch on the worker.
        worker: Which worker ran it.
    """

    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    computed_tokens: int = 0
    bytes_written: int = 0
    failures: list[DocumentFailure] = field(default_factory=list)
    seconds: float = 0.0
    worker: str = ""


@dataclass
class WarmReport:
    """Totals of a warm job.

    Attributes:
        documents: Documents in the source.
        computed: Documents computed and stored by this run.
        skipped: Documents found stored already (a resumed job skips what it did before).
        tokens: Tokens of the computed and skipped documents.
        computed_tokens: Tokens whose K/V this run computed.
        bytes_written: Bytes written to the shared tiers (Redis counts exactly; a disk folder
            by the growth of its usage).
        failures: Documents that could not be warmed, with the error.
        seconds: Wall time of the job, workers' start (model loading) included.
        startup_seconds: Part of ``seconds`` spent starting workers and loading models; the
            rates count the rest.
        workers: Workers that ran (1 without Ray).
        backend: ``"local"`` or ``"ray"``.
    """

    documents: int = 0
    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    computed_tokens: int = 0
    bytes_written: int = 0
    failures: list[DocumentFailure] = field(default_factory=list)
    seconds: float = 0.0
    startup_seconds: float = 0.0
    workers: int = 1
    backend: str = "local"

    @property
    def done(self) -> int:
        """Documents handled so far (computed, skipped or failed)."""
        return self.computed + self.skipped + len(self.failures)

    @property
    def warm_seconds(self) -> float:
        """Wall time once the workers were ready."""
        return max(0.0, self.seconds - self.startup_seconds)

    @property
    def documents_per_second(self) -> float:
        """Computed documents per second of wall time once the workers were ready."""
        return self.computed / self.warm_seconds if self.warm_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Computed tokens per second of wall time once the workers were ready."""
        return self.computed_tokens / self.warm_seconds if self.warm_seconds > 0 else 0.0

    def add(self, batch: BatchOutcome) -> None:
        """Count one batch's outcome."""
        self.computed += batch.computed
        self.skipped += batch.skipped
        self.tokens += batch.tokens
        self.computed_tokens += batch.computed_tokens
        self.bytes_written += batch.bytes_written
        self.failures.extend(batch.failures)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the rates (for JSON output)."""
        data = asdict(self)
        data["documents_per_second"] = self.documents_per_second
        data["tokens_per_second"] = self.tokens_per_second
        return data

    def summary(self) -> str:
        """One line for people."""
        return (
            f"{self.done}/{self.documents} documents ({self.computed} computed, {self.skipped} stored already, "
            f"{len(self.failures)} failed) in {self.seconds:.1f} s ({self.startup_seconds:.1f} s starting) on "
            f"{self.workers} {self.backend} worker(s): "
            f"{self.documents_per_second:.2f} documents/s, {self.tokens_per_second:.0f} tokens/s, "
            f"{self.bytes_written / 1e6:.1f} MB written"
        )
