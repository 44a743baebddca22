"""Host-to-device copies from pinned staging memory (never device->host)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["StagingRing", "staging_buffer", "to_device"]


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


class StagingRing:
    """A fixed ring of pinned staging buffers, each guarded by the event of the copy that
    read it.

    `take` returns a zeroed buffer whose previous host-to-device copy has finished: a free
    one when an event query says so, a new one while fewer than `depth` exist for that
    (size, dtype), else the oldest one after waiting on its event (back-pressure: the host
    is then `depth` steps ahead of the GPU, and never allocates pinned memory in the
    steady state). `release` hands a buffer back after its copy was enqueued. Off CUDA
    `take` is `staging_buffer` and `release` does nothing.

    Parameters
    ----------
    device : torch.device or str
    depth : int
        Buffers per (size, dtype).
    """

    def __init__(self, device: torch.device | str, depth: int = 8) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.depth = depth
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}
        self._count: dict[tuple[int, torch.dtype], int] = {}
        self.num_allocated = 0

    def take(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D CPU buffer of `size` elements (pinned on CUDA)."""
        if not self.cuda:
            return staging_buffer(size, dtype, "cpu")
        key = (size, dtype)
        pool = self._free.setdefault(key, [])  # oldest release first
        for i, (buf, event) in enumerate(pool):
            if event.query():
                del pool[i]
                return buf.zero_()
        if self._count.get(key, 0) < self.depth or not pool:
            self._count[key] = self._count.get(key, 0) + 1
            self.num_allocated += 1
            return self._alloc(size, dtype)
        buf, event = pool.pop(0)
        event.synchronize()  # the host is `depth` steps ahead: wait for the oldest copy
        return buf.zero_()

    def _alloc(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return staging_buffer(size, dtype, "cuda")

    def _event(self) -> Any:
        return torch.cuda.Event()

    def release(self, buf: torch.Tensor) -> None:
        """Give `buf` back once the copies reading it are enqueued on the current stream."""
        if not self.cuda:
            return
        event = self._event()
        event.record()
        self._free.setdefault((buf.shape[0], buf.dtype), []).append((buf, event))
