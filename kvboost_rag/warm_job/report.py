"""What a warm job did: per-batch outcomes and the job's totals and rates
(:class:`~kvboost_rag.warming.counts.WarmCounts` with who ran them and how fast)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvboost_rag.warming.counts import DocumentFailure, WarmCounts

__all__ = ["BatchOutcome", "DocumentFailure", "WarmCounts", "WarmReport"]


class BatchOutcome(WarmCounts):
    """What one worker did with one batch (:class:`WarmCounts`; ``seconds`` on the worker).

    Attributes:
        worker: Which worker ran it.
    """

    worker: str = ""


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
        data = self.model_dump(exclude={"results"})
        data["failures"] = [asdict(failure) for failure in self.failures]
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
