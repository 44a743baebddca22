"""Host-to-device copies from pinned staging memory (never device->host)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["to_device"]


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Copy a CPU numpy array to `device` without blocking the host.

    On CUDA the array is staged in pinned memory from PyTorch's caching host
    allocator, which keeps the block alive until the copy has run, so a later
    step can never overwrite data still in flight.

    Parameters
    ----------
    array : np.ndarray
        Any shape and numeric dtype; it is not modified.
    device : torch.device or str
        Target device ("cuda", "cpu", "meta", ...).

    Returns
    -------
    torch.Tensor
        Same shape and dtype as `array`, on `device`. On CPU a copy (never a
        view of `array`).
    """
    device = torch.device(device)
    src = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        staging.copy_(src)
        return staging.to(device, non_blocking=True)
    return src.to(device, copy=True)
