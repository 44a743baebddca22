"""Host-to-device copies from pinned staging memory (never device->host)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["staging_buffer", "to_device"]


def staging_buffer(size: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed 1-D CPU tensor to fill on the host and copy to `device`.

    Pinned, from PyTorch's caching host allocator, when `device` is CUDA: that
    allocator keeps the block alive until a non-blocking copy from it has run,
    so a later step can never overwrite data still in flight.

    Returns
    -------
    torch.Tensor
        `dtype` [size] on CPU.
    """
    pin = torch.device(device).type == "cuda"
    return torch.zeros(size, dtype=dtype, pin_memory=pin)


def to_device(array: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a CPU array or tensor to `device` without blocking the host.

    A pinned tensor is copied as is; anything else is staged in pinned memory
    first (see `staging_buffer`) when `device` is CUDA.

    Parameters
    ----------
    array : np.ndarray or torch.Tensor
        Any shape and numeric dtype, on CPU; it is not modified.
    device : torch.device or str
        Target device ("cuda", "cpu", "meta", ...).

    Returns
    -------
    torch.Tensor
        Same shape and dtype as `array`, on `device`. On CPU a copy (never a
        view of `array`).
    """
    device = torch.device(device)
    src = array if isinstance(array, torch.Tensor) else torch.from_numpy(
        np.ascontiguousarray(array))
    if device.type == "cuda":
        if not src.is_pinned():
            staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            src = staging.copy_(src)
        return src.to(device, non_blocking=True)
    return src.to(device, copy=True)
