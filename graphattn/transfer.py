"""Host <-> device transfers: pinned staging for inputs, `side_copy` on a side stream, and the
rings and futures that bring a step's tokens to the host without blocking."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["CurrentStream", "OutputRing", "StagingRing", "TokenFuture", "Uploader", "side_copy",
           "staging_buffer", "to_device"]

T = TypeVar("T")


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


class CurrentStream:
    """The current CUDA stream of one device, looked up per call at a fraction of
    ``torch.cuda.current_stream``'s cost (most of which builds a new Stream object; this keeps
    one per stream id).

    Parameters
    ----------
    device : torch.device or str
        A CUDA device; without an index, the device current when this is built.
    """

    __slots__ = ("index", "_cache", "_get")

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._cache: dict[int, torch.cuda.Stream] = {}
        self._get = getattr(torch._C, "_cuda_getCurrentStream", None)

    def __call__(self) -> torch.cuda.Stream:
        """The stream that work on this device is enqueued on now."""
        if self._get is None:
            return torch.cuda.current_stream(self.index)
        stream_id = self._get(self.index)[0]
        stream = self._cache.get(stream_id)
        if stream is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            stream = self._cache[stream_id] = torch.cuda.current_stream(self.index)
        return stream


def _set_stream(stream: torch.cuda.Stream) -> None:
    """``torch.cuda.set_stream`` without its wrappers (it also makes the stream's device
    current)."""
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)


class StagingRing:
    """A fixed ring of reusable host objects (pinned staging buffers, or plans holding
    one) per key, each guarded by an event recorded once the copies reading it are
    enqueued.

    `take` returns an object of `key` whose previous host-to-device copy has finished: a
    free one when an event query says so, a new one from `make()` while fewer than
    `depth` exist for that key, else the oldest one after waiting on its event
    (back-pressure: the host is then `depth` steps ahead of the GPU, and never allocates
    pinned memory in the steady state). The caller refills it whole. `release` hands it
    back after its copy was enqueued. Off CUDA `take` is `make()` and `release` does
    nothing.

    Parameters
    ----------
    device : torch.device or str
    depth : int
        Objects per key.
    """

    def __init__(self, device: torch.device | str, depth: int = 8) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.depth = depth
        self._free: dict[Hashable, list[tuple[Any, Any]]] = {}
        self._count: dict[Hashable, int] = {}
        self._events: dict[int, Any] = {}  # id(object) -> its event
        self.num_allocated = 0

    def take(self, key: Hashable, make: Callable[[], T]) -> T:
        """An object of `key` that no copy in flight reads (its old contents kept)."""
        if not self.cuda:
            return make()
        pool = self._free.setdefault(key, [])  # oldest release first
        for i, (obj, event) in enumerate(pool):
            if event.query():
                del pool[i]
                return obj
        if self._count.get(key, 0) < self.depth or not pool:
            self._count[key] = self._count.get(key, 0) + 1
            self.num_allocated += 1
            obj = make()
            self._events[id(obj)] = self._event()
            return obj
        obj, event = pool.pop(0)
        event.synchronize()  # the host is `depth` steps ahead: wait for the oldest copy
        return obj

    def _event(self) -> Any:
        return torch.cuda.Event()

    def release(self, key: Hashable, obj: Any, stream: Any = None) -> None:
        """Give `obj` back once the copies reading it are enqueued on `stream` (default: the
        current stream)."""
        if not self.cuda:
            return
        event = self._events[id(obj)]
        event.record(stream)
        self._free[key].append((obj, event))


class Uploader:
    """Copies pinned host buffers into static device buffers with the host read off the
    current stream.

    The host-to-device copy runs on a side stream into a ring of device buffers (one ring per
    shape and dtype), and the current stream only waits for it and copies device to device:
    the host read's PCIe latency overlaps the current stream's earlier work (the previous
    step's graph) instead of stalling the next. Off CUDA, or from a source that is not pinned,
    a plain non-blocking copy.

    Parameters
    ----------
    device : torch.device or str
    depth : int
        Device buffers per shape: a buffer is refilled only after the current stream's copy
        out of it `depth` uploads ago (ordered on the device; the host never waits).
    """

    def __init__(self, device: torch.device | str, depth: int = 2) -> None:
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.depth = depth
        self._rings: dict[tuple, list[tuple[torch.Tensor, Any, Any]]] = {}
        self._next: dict[tuple, int] = {}

    def copy_(self, dst: torch.Tensor, src: torch.Tensor,
              current: torch.cuda.Stream | None = None) -> None:
        """``dst.copy_(src)`` without blocking the host, the host read on the side stream.

        Parameters
        ----------
        dst : torch.Tensor
            Device tensor, contiguous.
        src : torch.Tensor
            Same shape and dtype: pinned host memory (else copied directly).
        current : torch.cuda.Stream, optional
            The current stream of `dst`'s device, when the caller has it.
        """
        if self.stream is None or dst.device.type != "cuda" or not src.is_pinned():
            dst.copy_(src, non_blocking=True)
            return
        key = (tuple(dst.shape), dst.dtype)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = [(torch.empty_like(dst), torch.cuda.Event(),
                                        torch.cuda.Event()) for _ in range(self.depth)]
        i = self._next.get(key, 0)
        self._next[key] = (i + 1) % self.depth
        buf, copied_out, landed = ring[i]
        if current is None:
            current = torch.cuda.current_stream(dst.device)
        side_copy(self.stream, current, copied_out, buf, src, landed)
        current.wait_event(landed)
        dst.copy_(buf)
        copied_out.record(current)


def side_copy(stream: torch.cuda.Stream, current: torch.cuda.Stream, after: Any,
              dst: torch.Tensor, src: torch.Tensor, done: Any) -> None:
    """``dst.copy_(src)`` (non-blocking) on `stream` once event `after` has run, then `done`
    recorded there; `current` is the stream to return to. The stream is switched directly,
    not by the ``torch.cuda.stream`` context manager, which queries the current stream twice
    more."""
    device = torch._C._cuda_getDevice()
    stream.wait_event(after)
    _set_stream(stream)  # also makes the stream's device current
    try:
        dst.copy_(src, non_blocking=True)
        done.record(stream)
    finally:
        _set_stream(current)
        if device != current.device_index:
            torch.cuda.set_device(device)


class TokenFuture:
    """A step's sampled tokens on their way to the host.

    On CUDA a non-blocking copy into a pinned ring slot followed by an event;
    `wait()` blocks on that event alone (never on later steps). The slot is
    reused `OutputRing.DEPTH` steps later: read a future before then (a later
    read raises instead of returning another step's tokens). Elsewhere the copy
    happens in `wait()`.
    """

    __slots__ = ("_src", "_ring", "_slot", "_version")

    def __init__(self, src: torch.Tensor, ring: OutputRing | None = None, slot: int = 0,
                 version: int = 0) -> None:
        self._src, self._ring, self._slot, self._version = src, ring, slot, version

    def ready(self) -> bool:
        """True when `wait()` would not block."""
        return self._ring is None or self._ring.events[self._slot].query()

    def wait(self) -> np.ndarray:
        """int64 [num_reqs] (or [num_reqs, width]) tokens (blocks until this step's copy has
        landed)."""
        if self._ring is None:
            return self._src.to("cpu").numpy().astype(np.int64, copy=True)
        if self._ring.versions[self._slot] != self._version:
            raise RuntimeError(f"this step's tokens were overwritten: read a TokenFuture within "
                               f"{OutputRing.DEPTH} steps")
        self._ring.events[self._slot].synchronize()
        return self._ring.host_np[self._slot][: self._src.shape[0]].copy()


class OutputRing:
    """Pinned host slots (CUDA) that a step's tokens are copied into without blocking
    (`width` columns per row when given).

    With a side `stream` the current stream copies the tokens into the slot's device buffer
    (a device copy) and the host copy runs on `stream`, so the host memory's latency does not
    hold up the next step on the current stream; without one the host copy runs on the
    current stream.
    """

    DEPTH = 8

    def __init__(self, max_num_reqs: int, device: torch.device, width: int | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.cuda = device.type == "cuda"
        n = self.DEPTH if self.cuda else 0
        shape = (max_num_reqs,) if width is None else (max_num_reqs, width)
        self.host = [torch.zeros(shape, dtype=torch.int64, pin_memory=True) for _ in range(n)]
        self.host_np = [h.numpy() for h in self.host]
        self.device = [torch.zeros(shape, dtype=torch.int64, device=device)
                       for _ in range(n if stream is not None else 0)]
        self.events = [torch.cuda.Event() for _ in range(n)]
        self.copied = [torch.cuda.Event() for _ in range(len(self.device))]
        self.versions = [0] * n
        self.stream = stream
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.i = 0

    def push(self, values: torch.Tensor, current: torch.cuda.Stream | None = None
             ) -> TokenFuture:
        """Send `values` (a device tensor of at most max_num_reqs rows) to the host;
        `current`: the current stream of its device, when the caller has it."""
        if not self.cuda:
            return TokenFuture(values)
        i, self.i = self.i, (self.i + 1) % self.DEPTH
        # the slot's previous copy (DEPTH steps ago) must have landed before it is reused;
        # a loop that reads tokens a step late never waits here
        self.events[i].synchronize()
        self.versions[i] += 1
        n = values.shape[0]
        if current is None:
            current = torch.cuda.current_stream(values.device)
        if self.stream is None:
            self.host[i][:n].copy_(values.long(), non_blocking=True)
            self.events[i].record(current)
            return TokenFuture(values, self, i, self.versions[i])
        views = self._views.get((i, n))
        if views is None:
            views = self._views[i, n] = (self.device[i][:n], self.host[i][:n])
        views[0].copy_(values)  # casts to int64 where needed
        self.copied[i].record(current)
        side_copy(self.stream, current, self.copied[i], views[1], views[0], self.events[i])
        return TokenFuture(values, self, i, self.versions[i])
