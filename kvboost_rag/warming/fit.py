"""Whether a corpus being warmed fits the cache's tiers, and what to tell the user.

Pure: the engine hands in sizes and budgets (and, after the warm, where each document is
kept); this module computes the estimate and writes the messages. A corpus that does not fit
the memory tier is fine when a disk or Redis tier takes the overflow; without one, documents
are evicted whole during the warm and must be computed again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

_MIB = 1024**2
#: The settings that make a large corpus fit, named in the warnings.
FIXES = (
    "disk_cache_dir='auto' or a folder (a disk tier takes what memory evicts), "
    "kv_cache_bits=8 (about 4x smaller K/V), or a larger max_cache_bytes"
)


def corpus_fit(token_counts: dict[str, int], bytes_per_token: float, budgets: tuple[int, int | None]) -> CorpusFit | None:
    """The bytes documents need against the tiers' budgets.

    Args:
        token_counts: Tokens of each distinct document (by digest).
        bytes_per_token: Bytes a stored token takes (the cache's estimate).
        budgets: ``(memory, lower)`` from :meth:`~kvboost_rag.cache.manager.CacheManager.tier_budgets`.

    Returns:
        The estimate, ``None`` when there are no documents.
    """
    if not token_counts:
        return None
    memory, lower = budgets
    return CorpusFit(
        documents=len(token_counts),
        needed_bytes=int(sum(token_counts.values()) * bytes_per_token),
        memory_bytes=memory,
        lower_bytes=lower,
    )


@dataclass(frozen=True)
class CorpusFit:
    """The bytes a warm needs against the tiers' budgets.

    Attributes:
        documents: Documents to compute.
        needed_bytes: Estimated bytes of their stored K/V.
        memory_bytes: Budget of the memory tier (``max_cache_bytes``) left beside pinned
            entries and indexes.
        lower_bytes: Budget of the tiers below memory (disk), ``None`` when unbounded
            (Redis), 0 when there are none.
    """

    documents: int
    needed_bytes: int
    memory_bytes: int
    lower_bytes: int | None

    @property
    def fits_memory(self) -> bool:
        """Whether every document stays in memory."""
        return self.needed_bytes <= self.memory_bytes

    @property
    def fits(self) -> bool:
        """Whether every document stays in some tier."""
        if self.fits_memory or self.lower_bytes is None:
            return True
        return self.needed_bytes <= self.memory_bytes + self.lower_bytes

    def warning(self) -> str:
        """The warning when the corpus does not fit (bytes needed, budgets, fixes)."""
        per_document = self.needed_bytes / max(1, self.documents)
        room = self.memory_bytes + (self.lower_bytes or 0)
        kept = min(self.documents, int(room / per_document)) if per_document else self.documents
        where = f"the memory tier holds {self.memory_bytes / _MIB:.0f} MiB"
        if self.lower_bytes:
            where += f" and the disk tier {self.lower_bytes / _MIB:.0f} MiB"
        return (
            f"warm_documents: {self.documents} documents need about {self.needed_bytes / _MIB:.0f} MiB of K/V "
            f"but {where}: about {self.documents - kept} documents will be evicted (whole) and computed "
            f"again when prompts hold them; fixes: {FIXES}"
        )


    def overflow_line(self) -> str:
        """The note when the corpus fits only with the tiers below memory."""
        return (
            f"warm_documents: {self.documents} documents need about {self.needed_bytes / _MIB:.0f} MiB of K/V, "
            f"more than the memory tier's {self.memory_bytes / _MIB:.0f} MiB: the overflow goes to the tiers below"
        )


def kept_summary(kept_in: Sequence[Sequence[str]]) -> tuple[int, dict[str, int]]:
    """How many documents the tiers keep, and how many are where (``"memory"``,
    ``"disk"``, ``"memory+disk"`` for a document whose entries two tiers hold between them).

    Args:
        kept_in: For each document, the tiers holding its entries (empty: gone).
    """
    by_place: Counter[str] = Counter("+".join(tiers) for tiers in kept_in if tiers)
    return sum(by_place.values()), dict(by_place)


def summary_line(total: int, kept: int, by_tier: dict[str, int], computed_bytes: int) -> str:
    """The log line closing a warm: documents kept and where."""
    where = ", ".join(f"{name} {count}" for name, count in by_tier.items()) or "none"
    line = f"warm_documents: {kept} of {total} documents kept ({where}); {computed_bytes / _MIB:.0f} MiB of K/V computed"
    if kept < total:
        line += f"; {total - kept} evicted during the warm (no lower tier kept them): {FIXES}"
    return line
