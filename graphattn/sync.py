"""Detection of host reads of device state (GPU->CPU syncs).

`no_host_sync()` raises on any such read; `count_host_syncs()` counts them
instead, for demos and benchmarks that report "host syncs per step".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)

__all__ = [
    "HostSyncError",
    "SyncCounter",
    "count_host_syncs",
    "host_sync_allowed",
    "no_host_sync",
    "note_host_read",
    "opaque_region",
]


class HostSyncError(RuntimeError):
    """A host read of device state happened inside `no_host_sync()`."""


# Ops that read tensor data back to the host or produce data-dependent shapes.
_READ_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select",
    "_unique2", "unique_dim", "unique_consecutive",
})
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_COPY_OPS = frozenset({"_to_copy", "copy_"})


def _is_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _sync_reason(func: object, args: tuple, kwargs: dict) -> str | None:
    name = getattr(getattr(func, "overloadpacket", None), "__name__", None)
    if name is None:
        return None
    if name in _READ_OPS:
        return f"aten.{name}"
    if name in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return f"aten.{name} with a boolean mask (data-dependent shape)"
        return None
    if name == "repeat_interleave" and getattr(func, "_overloadname", "") == "Tensor" and (
        kwargs.get("output_size") is None and (len(args) < 2 or args[1] is None)
    ):
        return "aten.repeat_interleave without output_size"
    if name in _COPY_OPS:
        if name == "copy_":
            dst, src = args[0], args[1]
            if _is_device(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                if non_blocking and dst.is_pinned():
                    return None  # an async copy into pinned memory: no host read until waited on
                return "aten.copy_ device->cpu"
            return None
        src = args[0]
        target = kwargs.get("device")
        if _is_device(src) and target is not None and torch.device(target).type == "cpu":
            return f"aten.{name} device->cpu"
    return None


@dataclass(slots=True)
class SyncCounter:
    """Host reads of device state seen while a `count_host_syncs()` block ran.

    Attributes
    ----------
    count : int
        Number of reads seen.
    reasons : list[str]
        The op behind each read, in order.
    """

    count: int = 0
    reasons: list[str] = field(default_factory=list)


class _SyncMode(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, counter: SyncCounter | None) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            if self.counter is None:
                raise HostSyncError(f"host read of device state inside no_host_sync(): {reason}")
            self.counter.count += 1
            self.counter.reasons.append(reason)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _cuda_sync_debug(mode: str) -> Iterator[None]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise `HostSyncError` on any host read of device state inside the block.

    Flags ``aten._local_scalar_dense`` (``.item()``, ``int()``/``bool()`` of a
    tensor), ``nonzero``, ``equal``, ``is_nonzero``, ``masked_select`` and
    device->CPU copies on every device. On CUDA it also sets
    ``torch.cuda.set_sync_debug_mode("error")``, so a synchronizing CUDA call
    raises ``RuntimeError``.

    Examples
    --------
    >>> with no_host_sync():
    ...     torch.ones(2).sum()  # fine
    """
    with _cuda_sync_debug("error"), _SyncMode(None):
        yield


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Count (not raise on) host reads of device state inside the block.

    Sees the same ops as `no_host_sync()` at the dispatcher level, each read
    counted once.

    Yields
    ------
    SyncCounter
        Filled in while the block runs.
    """
    counter = SyncCounter()
    with _SyncMode(counter):
        yield counter


def note_host_read(what: str) -> None:
    """Declare a host read of device state that the dispatcher cannot see.

    Raises `HostSyncError` inside `no_host_sync()` and counts inside
    `count_host_syncs()`, whatever the device (so CPU tests see it too).
    """
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _SyncMode):
            if mode.counter is None:
                raise HostSyncError(f"host read of device state inside no_host_sync(): {what}")
            mode.counter.count += 1
            mode.counter.reasons.append(what)
            return


@contextlib.contextmanager
def opaque_region() -> Iterator[None]:
    """Lift the dispatcher-level check for a torch-compiled region.

    Dynamo refuses to trace (and flex_attention refuses to run) while a Python
    dispatch mode is active, so compiled code (torch.compile artifacts,
    flex_attention) runs in this block with the check of `no_host_sync()`
    paused. On CUDA, ``set_sync_debug_mode("error")`` still applies inside, so
    a synchronizing CUDA call there is still caught.
    """
    stack = _get_current_dispatch_mode_stack()
    if not stack or not isinstance(stack[-1], _SyncMode):
        yield
        return
    with _pop_mode_temporarily():
        yield


@contextlib.contextmanager
def host_sync_allowed() -> Iterator[None]:
    """Lift `no_host_sync()` (and `count_host_syncs()`) for a block that synchronizes on
    purpose, outside any step's device work: a lazy capture between steps."""
    stack = _get_current_dispatch_mode_stack()
    lifted = (_pop_mode_temporarily() if stack and isinstance(stack[-1], _SyncMode)
              else contextlib.nullcontext())
    with _cuda_sync_debug("default"), lifted:
        yield
