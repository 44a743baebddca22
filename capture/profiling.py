"""NVTX ranges per pipeline stage, mirrored as torch.profiler labels.

Nsight Systems (``nsys profile -t cuda,nvtx``) shows the ranges in domain
"graphattn"; torch.profiler traces show the same stages as
``graphattn::<stage> <key>`` record_function events. With no profiler
recording, a range costs one flag check and an NVTX push/pop, which the NVTX
library turns into no-ops when no tool is attached.
"""

from __future__ import annotations

import contextlib
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

    def range(self, stage: str, key: Any = None) -> contextlib.AbstractContextManager[None]:
        """One stage; `key` (a GraphKey) goes into the message."""
        if not self.enabled:
            return _NULL
        if stage not in STAGE_COLORS:
            raise ValueError(f"unknown stage {stage!r}, expected one of {sorted(STAGE_COLORS)}")
        return _Range(self, stage, key)


class _Range:
    __slots__ = ("prof", "stage", "key", "label")

    def __init__(self, prof: StageProfiler, stage: str, key: Any) -> None:
        self.prof, self.stage, self.key, self.label = prof, stage, key, None

    def __enter__(self) -> None:
        prof = self.prof
        message = self.stage if self.key is None else f"{self.stage} {self.key}"
        if prof.torch_labels and torch.autograd.profiler._is_profiler_enabled:
            self.label = torch.autograd.profiler.record_function(f"graphattn::{message}")
            self.label.__enter__()
        if prof.nvtx is not None:
            prof.nvtx.push_range(message, color=STAGE_COLORS[self.stage], domain=prof.domain)
        prof.depth += 1

    def __exit__(self, *exc: object) -> None:
        prof = self.prof
        prof.depth -= 1
        if prof.nvtx is not None:
            prof.nvtx.pop_range(domain=prof.domain)
        if self.label is not None:
            self.label.__exit__(None, None, None)


_NULL = contextlib.nullcontext()
