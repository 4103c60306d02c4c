"""Host-to-device copies that never make the host wait.

A copy from ordinary (pageable) host memory to a GPU synchronizes the stream before it starts:
the host waits for every kernel queued before it. Small tables the host computes (indexes,
rotation angles, positions) go through page-locked memory instead, so the copy is queued like a
kernel and the host goes on. PyTorch's pinned-memory allocator keeps the staging buffer alive
until the copy has run.
"""

from __future__ import annotations

import torch


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, without a host synchronization on CUDA.

    Args:
        tensor: A CPU tensor.
        device: The target device (CPU: the tensor itself).
    """
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    # contiguous(): an expanded view (one element behind several indexes) cannot be pinned.
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)
