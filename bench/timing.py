"""Timing helpers: per-step times (CUDA events on the GPU, host clock on CPU) with spread."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from graphattn.sync import count_host_syncs

WARMUP = 5


def drain(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_times(fn: Callable[[int], object], steps: int, device: str, warmup: int = WARMUP,
               desc: str = "steps") -> np.ndarray:
    """µs of each of `steps` calls of ``fn(i)`` after `warmup` untimed ones.

    On CUDA: CUDA events recorded around each call (the device time the step took, idle
    gaps while the host lags included); elsewhere the host clock around each call.
    """
    for i in range(warmup):
        fn(i)
    drain(device)
    bar = tqdm(range(steps), desc=desc, unit="step", leave=False)
    if device == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
        for i in bar:
            ev[i][0].record()
            fn(warmup + i)
            ev[i][1].record()
        torch.cuda.synchronize()
        return 1e3 * np.array([a.elapsed_time(b) for a, b in ev])
    out = np.empty(steps)
    for i in bar:
        t0 = time.perf_counter()
        fn(warmup + i)
        out[i] = 1e6 * (time.perf_counter() - t0)
    return out


def spread(times: np.ndarray, prefix: str = "us") -> dict[str, float]:
    """Median and interquartile range of per-step µs."""
    return {f"{prefix}_step": float(np.median(times)),
            f"{prefix}_p25": float(np.percentile(times, 25)),
            f"{prefix}_p75": float(np.percentile(times, 75))}


def syncs_per_step(fn: Callable[[], object], steps: int = 3) -> float:
    """Host reads of device state per call, counted at the dispatcher."""
    with count_host_syncs() as c:
        for _ in range(steps):
            fn()
    return c.count / steps


def capture_warm(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn`, warmed up first on the stream it is captured on (as the runner
    captures), so whatever a launch makes once per stream outside capture (the attention
    kernels' split counters) exists when it is recorded."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    return g
