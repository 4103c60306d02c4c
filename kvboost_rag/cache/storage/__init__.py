"""Storage tiers for K/V entries (memory, disk, Redis) and the store that stacks them."""

from __future__ import annotations

import logging
import math

import torch

from kvboost_rag.cache.device_memory import free_device_memory, plan_device_memory
from kvboost_rag.cache.storage.base import (
    HOST_TENSORS,
    KIND_FIELD,
    StorageTier,
    StoredEntry,
)
from kvboost_rag.cache.storage.device import DeviceTier, PinnedMemoryTier
from kvboost_rag.cache.storage.disk import DiskTier
from kvboost_rag.cache.storage.memory import MemoryTier
from kvboost_rag.cache.storage.policy import FrequencyRecencyPolicy
from kvboost_rag.cache.storage.serialization import (
    CorruptPayloadError,
    deserialize_entry,
    serialize_entry,
)
from kvboost_rag.cache.storage.tiered import TieredStore
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.log_limits import RateLimitedLogger

__all__ = [
    "CorruptPayloadError",
    "DeviceTier",
    "DiskTier",
    "FrequencyRecencyPolicy",
    "HOST_TENSORS",
    "KIND_FIELD",
    "MemoryTier",
    "PinnedMemoryTier",
    "StorageTier",
    "StoredEntry",
    "TieredStore",
    "build_store",
    "deserialize_entry",
    "serialize_entry",
    "warn_if_shared_without_key",
]


logger = logging.getLogger(__name__)

#: Once per process: a tier other processes write, shared without ``cache_secret_key``.
_unsigned_tier_warnings = RateLimitedLogger(logger, interval_seconds=math.inf)

def warn_if_shared_without_key(settings: KVBoostSettings) -> bool:
    """Warn (once per process) when a disk folder or Redis is shared without
    ``cache_secret_key``: its entries then carry a SHA-256 checksum only, so whoever can write
    there can plant K/V this engine will load and serve. The ``"auto"`` disk folder (the user's
    own spill-over) is not counted as shared.

    Returns:
        Whether the warning was logged now.
    """
    if settings.cache_secret_key is not None:
        return False
    shared = []
    if settings.disk_cache_dir not in (None, "auto"):
        shared.append(f"the disk folder {settings.disk_cache_dir}")
    if settings.redis_url is not None:
        shared.append("Redis")
    if not shared:
        return False
    return _unsigned_tier_warnings.warning(
        "shared-tier-without-key",
        "%s shared without cache_secret_key: entries carry a checksum only, so anyone who can write "
        "there can plant K/V this engine will serve; set cache_secret_key (kvboost-rag --secret-key-env) "
        "on every process sharing the store",
        " and ".join(shared),
    )


def build_store(
    settings: KVBoostSettings, device: torch.device | str | None = None, device_tier_bytes: int | None = None
) -> TieredStore:
    """Build the tier stack the settings ask for: memory, then disk and Redis when configured.

    ``disk_cache_dir="auto"`` (the default) adds an overflow disk tier in
    :func:`~kvboost_rag.default_model.default_kv_cache_dir` that receives only what the memory
    tier evicts; a folder given explicitly is a write-through tier (every entry is written, so
    other processes and restarts find it).

    With ``device`` a CUDA device, a :class:`DeviceTier` of ``device_tier_bytes`` (unless 0)
    goes on top and the memory tier keeps its tensors in pinned memory
    (:class:`PinnedMemoryTier`), so promotions to the device are asynchronous copies.

    Args:
        settings: Uses ``max_cache_bytes``, ``device_cache_bytes``, ``disk_cache_dir``,
            ``max_disk_bytes``, ``redis_url``, ``redis_cluster``, ``redis_ttl_seconds`` and ``cache_secret_key``
            (which authenticates disk and Redis entries; the in-process tiers need none; a
            disk folder or Redis without it is warned about once per process:
            :func:`warn_if_shared_without_key`).
        device: The device the model runs on; ``None`` or a CPU device adds no device tier.
        device_tier_bytes: The device tier's budget as planned with the rest of the device's
            memory (:func:`~kvboost_rag.cache.device_memory.plan_device_memory`); ``None``:
            planned by the same rule from ``device_cache_bytes`` alone (no captured steps'
            pool).

    Raises:
        ImportError: ``redis_url`` is set but the ``redis`` package is missing.
        InvalidInputError: ``disk_cache_dir`` is an existing file.
    """
    warn_if_shared_without_key(settings)
    secret = settings.cache_secret_key
    secret_key = secret.get_secret_value().encode("utf-8") if secret is not None else None
    accelerator = device is not None and torch.device(device).type == "cuda"
    tiers: list[StorageTier] = []
    if not accelerator:
        device_bytes = 0
    elif device_tier_bytes is not None:
        device_bytes = device_tier_bytes
    else:
        free = free_device_memory(torch.device(device))
        device_bytes = plan_device_memory(free, 0, 0, pool=None, device_tier=settings.device_cache_bytes).device_tier_bytes
    if device_bytes > 0:
        tiers.append(DeviceTier(device_bytes, device))
    tiers.append(PinnedMemoryTier(settings.max_cache_bytes) if accelerator else MemoryTier(settings.max_cache_bytes))
    if settings.disk_cache_dir == "auto":
        from kvboost_rag.default_model import default_kv_cache_dir

        folder = default_kv_cache_dir()
        if folder is not None:
            tiers.append(DiskTier(folder, settings.max_disk_bytes, secret_key=secret_key, spill_only=True))
    elif settings.disk_cache_dir is not None:
        tiers.append(DiskTier(settings.disk_cache_dir, settings.max_disk_bytes, secret_key=secret_key))
    if settings.redis_url is not None:
        from kvboost_rag.cache.storage.redis_tier import RedisTier

        tiers.append(
            RedisTier(
                settings.redis_url,
                settings.redis_ttl_seconds,
                cluster=settings.redis_cluster,
                secret_key=secret_key,
            )
        )
    return TieredStore(tiers)
