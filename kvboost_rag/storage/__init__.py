"""Storage tiers for K/V entries (memory, disk, Redis) and the store that stacks them."""

from __future__ import annotations

from kvboost_rag.config import KVBoostSettings
from kvboost_rag.storage.base import StorageTier, StoredEntry
from kvboost_rag.storage.memory import MemoryTier
from kvboost_rag.storage.policy import FrequencyRecencyPolicy
from kvboost_rag.storage.tiered import TieredStore

__all__ = ["FrequencyRecencyPolicy", "MemoryTier", "StorageTier", "StoredEntry", "TieredStore", "build_store"]


def build_store(settings: KVBoostSettings) -> TieredStore:
    """Build the tier stack the settings ask for (memory, then disk and Redis when configured)."""
    tiers: list[StorageTier] = [MemoryTier(settings.max_cache_bytes)]
    if settings.disk_cache_dir is not None:
        raise NotImplementedError("disk tier is not available yet")
    if settings.redis_url is not None:
        raise NotImplementedError("redis tier is not available yet")
    return TieredStore(tiers)
