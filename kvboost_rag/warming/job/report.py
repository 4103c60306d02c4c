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
class WarmCounts:
    """What warming some documents did (a batch's outcome, or a job's totals).

    Attributes:
        computed: Documents whose K/V was computed and stored.
        skipped: Documents stored already (by an earlier run or another worker): only their
            records were read.
        tokens: Tokens of the documents warmed or skipped.
        computed_tokens: Tokens whose K/V was computed.
        bytes_written: Bytes written to the shared tiers (Redis counts exactly; a disk folder
            by the growth of its usage).
        failures: Documents that could not be warmed, with the error.
        seconds: Wall time.
    """

    computed: int = 0
    skipped: int = 0
    tokens: int = 0
    computed_tokens: int = 0
    bytes_written: int = 0
    failures: list[DocumentFailure] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, other: WarmCounts) -> None:
        """Count ``other``'s documents, tokens, bytes and failures in (not its time)."""
        self.computed += other.computed
        self.skipped += other.skipped
        self.tokens += other.tokens
        self.computed_tokens += other.computed_tokens
        self.bytes_written += other.bytes_written
        self.failures.extend(other.failures)


@dataclass
class BatchOutcome(WarmCounts):
    """What one worker did with one batch (:class:`WarmCounts`; ``seconds`` on the worker).

    Attributes:
        worker: Which worker ran it.
    """

    worker: str = ""


@dataclass
class WarmReport(WarmCounts):
    """Totals of a warm job (:class:`WarmCounts`; ``seconds`` is the job's wall time, workers'
    start and model loading included).

    Attributes:
        documents: Documents in the source.
        startup_seconds: Part of ``seconds`` spent starting workers and loading models; the
            rates count the rest.
        workers: Workers that ran (1 without Ray).
        backend: ``"local"`` or ``"ray"``.
    """

    documents: int = 0
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
