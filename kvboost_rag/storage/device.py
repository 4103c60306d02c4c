"""Tiers for a model on an accelerator: a hot tier in device memory, a pinned CPU tier below it.

On CUDA a cache hit served from ordinary (pageable) CPU memory is a synchronous host-to-device
copy. Two tiers change that:

- :class:`DeviceTier` keeps the hottest entries in device memory under its own byte budget, so
  a hit costs no transfer at all. Quantized entries stay quantized there and are dequantized
  on the device by the codec.
- :class:`PinnedMemoryTier` is the memory tier with its tensors in page-locked memory, so the
  copy of an entry promoted to the device tier is issued with ``non_blocking=True`` and the
  host goes on (with the next lookups, stitching and the selection pass's kernel launches)
  while the copy engine moves the bytes. Work queued later on the same stream sees the data.

``build_store`` stacks them (device, pinned memory, disk, Redis) when the model runs on CUDA;
on CPU neither is used.
"""

from __future__ import annotations

import torch

from kvboost_rag.storage.base import StoredEntry
from kvboost_rag.storage.memory import MemoryTier
from kvboost_rag.storage.policy import FrequencyRecencyPolicy


class DeviceTier(MemoryTier):
    """Entries held as tensors on an accelerator, with a byte budget of device memory.

    Args:
        max_bytes: Byte budget in device memory; unpinned entries are evicted (lowest decayed
            frequency first) to stay within it.
        device: Where entries live (``"cuda"``, ``"cuda:1"``; ``"cpu"`` works too, for tests).
        policy: Eviction policy (a fresh :class:`FrequencyRecencyPolicy` by default).
    """

    name = "device"

    def __init__(self, max_bytes: int, device: torch.device | str, policy: FrequencyRecencyPolicy | None = None) -> None:
        super().__init__(max_bytes, policy)
        self.device = torch.device(device)

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        """Copy ``entry`` to the device (asynchronously when its tensors are pinned) and hold it."""
        return super().put(key, self.on_device(entry))

    def resident(self, key: str) -> StoredEntry | None:
        """The entry held under ``key`` without counting a use (for the store's promotion)."""
        with self._lock:
            return self._entries.get(key)

    def on_device(self, entry: StoredEntry) -> StoredEntry:
        """``entry`` with every tensor on this tier's device."""
        if all(t.device == self.device for name, t in entry.tensors.items() if name != "token_ids"):
            return entry
        # Token ids stay on the host: they are compared with prompt tokens there.
        tensors = {name: t if name == "token_ids" else _to_device(t, self.device) for name, t in entry.tensors.items()}
        return StoredEntry(tensors=tensors, metadata=dict(entry.metadata))


class PinnedMemoryTier(MemoryTier):
    """The memory tier with every tensor in page-locked (pinned) CPU memory.

    Needs a CUDA build of PyTorch with a GPU present (pinning is a CUDA driver call).

    Args:
        max_bytes: Byte budget.
        policy: Eviction policy (a fresh :class:`FrequencyRecencyPolicy` by default).
    """

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        """Store ``entry`` with its tensors on the CPU in pinned memory."""
        return super().put(key, pinned(entry))


def pinned(entry: StoredEntry) -> StoredEntry:
    """``entry`` with every tensor in pinned CPU memory (a copy only where needed)."""
    if all(t.device.type == "cpu" and t.is_pinned() for t in entry.tensors.values()):
        return entry
    tensors = {name: t.to("cpu").pin_memory() for name, t in entry.tensors.items()}
    return StoredEntry(tensors=tensors, metadata=dict(entry.metadata))


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy to ``device``; from pinned memory the copy is queued and the host returns at once."""
    asynchronous = tensor.device.type == "cpu" and device.type != "cpu" and tensor.is_pinned()
    return tensor.to(device, non_blocking=asynchronous)
