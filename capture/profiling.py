"""NVTX ranges per pipeline stage, mirrored as torch.profiler labels.

Nsight Systems (``nsys profile -t cuda,nvtx``) shows the ranges in domain
"graphattn"; torch.profiler traces show the same stages as
``graphattn::<stage> <key>`` record_function events. With no profiler
recording, a range costs one flag check and an NVTX push/pop, which the NVTX
library turns into no-ops when no tool is attached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

try:
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - nvtx is a dependency, but keep running without it
    _nvtx = None

__all__ = ["STAGE_COLORS", "StageProfiler"]

STAGE_COLORS = {
    "prepare": "blue",
    "build": "green",
    "dispatch": "yellow",
    "capture": "red",
    "replay": "purple",
    "eager": "orange",
    "postprocess": "cyan",
}


class StageProfiler:
    """Context-manager ranges for the stages of a step.

    Parameters
    ----------
    enabled : bool
        False turns every range into a bare yield.
    domain : str
        NVTX domain.
    nvtx_ranges, torch_labels : bool
        Emit NVTX ranges / torch.profiler record_function labels.

    Attributes
    ----------
    depth : int
        Ranges open now (0 between steps, also after a step raised).
    """

    def __init__(self, enabled: bool = True, domain: str = "graphattn", nvtx_ranges: bool = True,
                 torch_labels: bool = True) -> None:
        self.enabled = enabled
        self.domain = domain
        self.nvtx = _nvtx if (nvtx_ranges and _nvtx is not None) else None
        self.torch_labels = torch_labels
        self.depth = 0

    @contextlib.contextmanager
    def range(self, stage: str, key: Any = None) -> Iterator[None]:
        """One stage; `key` (a GraphKey) goes into the message."""
        if not self.enabled:
            yield
            return
        if stage not in STAGE_COLORS:
            raise ValueError(f"unknown stage {stage!r}, expected one of {sorted(STAGE_COLORS)}")
        message = stage if key is None else f"{stage} {key}"
        label = None
        if self.torch_labels and torch.autograd.profiler._is_profiler_enabled:
            label = torch.autograd.profiler.record_function(f"graphattn::{message}")
            label.__enter__()
        if self.nvtx is not None:
            self.nvtx.push_range(message, color=STAGE_COLORS[stage], domain=self.domain)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.nvtx is not None:
                self.nvtx.pop_range(domain=self.domain)
            if label is not None:
                label.__exit__(None, None, None)
