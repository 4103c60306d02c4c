"""Tiers for a model on an accelerator: a hot tier in device memory, a pinned CPU tier below it.

On CUDA a cache hit served from ordinary (pageable) CPU memory is a synchronous host-to-device
copy. Two tiers change that:

- :class:`DeviceTier` keeps the hottest K/V in device memory under its own byte budget, so a
  hit costs no transfer at all. It holds K/V only: entries that are host metadata (document
  records, :attr:`~kvboost_rag.cache.storage.base.StoredEntry.host_only`) are never placed there, and
  the tensors the host reads (token ids, :data:`~kvboost_rag.cache.storage.base.HOST_TENSORS`) stay
  in host memory. Entries of one group (a document's chunks) moved together share one device
  allocation, filled by one copy per dtype, and leave together (eviction is by group).
  Quantized entries stay quantized there and are dequantized on the device by the codec.
- :class:`PinnedMemoryTier` is the memory tier with its tensors in page-locked memory, so the
  copy of an entry promoted to the device tier is issued with ``non_blocking=True`` and the
  host goes on (with the next lookups, stitching and the selection pass's kernel launches)
  while the copy engine moves the bytes. Work queued later on the same stream sees the data.

``build_store`` stacks them (device, pinned memory, disk, Redis) when the model runs on CUDA;
on CPU neither is used.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kvboost_rag.cache.storage.base import HOST_TENSORS, StoredEntry
from kvboost_rag.cache.storage.memory import MemoryTier
from kvboost_rag.cache.storage.policy import FrequencyRecencyPolicy


class DeviceTier(MemoryTier):
    """K/V entries held as tensors on an accelerator, with a byte budget of device memory.

    Args:
        max_bytes: Byte budget in device memory; unpinned groups are evicted (lowest decayed
            frequency first) to stay within it.
        device: Where entries live (``"cuda"``, ``"cuda:1"``; ``"cpu"`` or ``"meta"`` work too,
            for tests).
        policy: Eviction policy (a fresh :class:`FrequencyRecencyPolicy` by default).
    """

    name = "device"

    def __init__(self, max_bytes: int, device: torch.device | str, policy: FrequencyRecencyPolicy | None = None) -> None:
        super().__init__(max_bytes, policy)
        self.device = torch.device(device)

    def put(self, key: str, entry: StoredEntry) -> list[str]:
        """Copy ``entry``'s K/V to the device (asynchronously when its tensors are pinned) and
        hold it; host metadata is not held (nothing is stored, nothing evicted)."""
        return self.put_many([(key, entry)])

    def put_many(self, items: list[tuple[str, StoredEntry]]) -> list[str]:
        """Hold several K/V entries; those of one group move in one copy per dtype.

        Host metadata among ``items`` is skipped.

        Returns:
            The keys evicted to make room.
        """
        held = [(key, entry) for key, entry in items if not entry.host_only]
        groups: dict[str, list[tuple[str, StoredEntry]]] = defaultdict(list)
        for key, entry in held:
            groups[self._group_name(key)].append((key, entry))
        evicted: list[str] = []
        for members in groups.values():
            for key, entry in zip([k for k, _ in members], self.on_device([e for _, e in members])):
                evicted += super().put(key, entry)
        return evicted

    def resident(self, key: str) -> StoredEntry | None:
        """The entry held under ``key`` without counting a use (for the store's promotion)."""
        with self._lock:
            return self._entries.get(key)

    def on_device(self, entries: list[StoredEntry]) -> list[StoredEntry]:
        """``entries`` with every K/V tensor on this tier's device: the tensors of each dtype
        not there yet go into one device allocation (:func:`_move_together`); each entry's
        tensors are views of it."""
        moving: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for entry in entries:
            for name, tensor in entry.tensors.items():
                if name not in HOST_TENSORS and tensor.device != self.device:
                    moving[tensor.dtype].append(tensor)
        moved: dict[int, torch.Tensor] = {}
        for tensors in moving.values():
            for tensor, copy in zip(tensors, _move_together(tensors, self.device)):
                moved[id(tensor)] = copy
        return [
            StoredEntry(
                tensors={name: moved.get(id(t), t) for name, t in entry.tensors.items()},
                metadata=dict(entry.metadata),
            )
            if any(id(t) in moved for t in entry.tensors.values())
            else entry
            for entry in entries
        ]


def _move_together(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of same-dtype host ``tensors`` on ``device`` in one device allocation: tensors in
    page-locked memory are copied straight into their places (asynchronous transfers, no host
    copy); others are packed into one page-locked buffer first (one host copy, one transfer).
    Each copy is a view of the allocation."""
    if any(t.device.type != "cpu" for t in tensors):  # from another device: one by one
        return [t.to(device) for t in tensors]
    sizes = [t.numel() for t in tensors]
    on_device = torch.empty(sum(sizes), dtype=tensors[0].dtype, device=device)  # [total]
    parts = [part.view(t.shape) for part, t in zip(on_device.split(sizes), tensors)]
    gpu = device.type == "cuda"
    if gpu and all(t.is_pinned() for t in tensors):
        for part, tensor in zip(parts, tensors):
            part.copy_(tensor, non_blocking=True)
        return parts
    packed = torch.empty(sum(sizes), dtype=tensors[0].dtype, pin_memory=gpu)
    torch.cat([t.reshape(-1) for t in tensors], out=packed)  # [total]
    on_device.copy_(packed, non_blocking=gpu)
    return parts


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
    """``entry`` with every tensor the device reads in pinned CPU memory: a copy of each one
    that is not (the write-back's copies already are: they come from a page-locked arena); the
    tensors only the host reads (:data:`HOST_TENSORS`) stay as they are."""

    def ready(name: str, tensor: torch.Tensor) -> bool:
        return name in HOST_TENSORS or _is_pinned(tensor)

    if all(ready(name, t) for name, t in entry.tensors.items()):
        return entry
    tensors = {name: t if ready(name, t) else t.to("cpu").pin_memory() for name, t in entry.tensors.items()}
    return StoredEntry(tensors=tensors, metadata=dict(entry.metadata))


def _is_pinned(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_pinned()
