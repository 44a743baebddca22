"""Timing helpers: wall time per step with the device drained at both ends."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from graphattn.sync import count_host_syncs


def drain(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


WARMUP = 5


def us_per_step(fn: Callable[[], object], steps: int, device: str, warmup: int = WARMUP) -> float:
    for _ in range(warmup):
        fn()
    drain(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    drain(device)
    return 1e6 * (time.perf_counter() - t0) / steps


def syncs_per_step(fn: Callable[[], object], steps: int = 3) -> float:
    """Host reads of device state per call, counted at the dispatcher."""
    with count_host_syncs() as c:
        for _ in range(steps):
            fn()
    return c.count / steps
