"""NVTX ranges per pipeline stage, mirrored as torch.profiler labels.

Nsight Systems (``nsys profile -t cuda,nvtx``) shows the ranges in domain
"graphattn"; torch.profiler traces show the same stages as
``graphattn::<stage> <key>`` record_function events. Ranges go through a
cached `nvtx.Domain` with one cached event-attributes object per (stage, key),
so a range costs a dict lookup and a domain push/pop (which the NVTX library
turns into no-ops when no tool is attached).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import nvtx
import torch

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
    record_times : bool
        Keep the host seconds of every range in `times` (the benchmarks' per-stage columns).

    Attributes
    ----------
    depth : int
        Ranges open now (0 between steps, also after a step raised).
    times : dict[str, list[float]]
        Host seconds per stage, one entry per range (with `record_times`).
    """

    def __init__(self, enabled: bool = True, domain: str = "graphattn", nvtx_ranges: bool = True,
                 torch_labels: bool = True, record_times: bool = False) -> None:
        self.enabled = enabled
        self.domain = domain
        self.nvtx = nvtx.get_domain(domain) if nvtx_ranges else None
        self.torch_labels = torch_labels
        self.depth = 0
        self._attributes: dict[tuple[str, Any], Any] = {}
        self.record_times = record_times
        self.times: dict[str, list[float]] = {}

    def attributes(self, stage: str, key: Any) -> Any:
        """Cached NVTX event attributes of a (stage, key) range."""
        try:
            return self._attributes[(stage, key)]
        except KeyError:
            message = stage if key is None else f"{stage} {key}"
            attr = self.nvtx.get_event_attributes(message=message, color=STAGE_COLORS[stage])
            self._attributes[(stage, key)] = attr
            return attr

    def range(self, stage: str, key: Any = None) -> contextlib.AbstractContextManager[None]:
        """One stage; `key` (a GraphKey) goes into the message."""
        if not self.enabled:
            return _NULL
        if stage not in STAGE_COLORS:
            raise ValueError(f"unknown stage {stage!r}, expected one of {sorted(STAGE_COLORS)}")
        return _Range(self, stage, key)


class _Range:
    __slots__ = ("prof", "stage", "key", "label", "t0")

    def __init__(self, prof: StageProfiler, stage: str, key: Any) -> None:
        self.prof, self.stage, self.key, self.label, self.t0 = prof, stage, key, None, 0.0

    def __enter__(self) -> None:
        prof = self.prof
        if prof.torch_labels and torch.autograd.profiler._is_profiler_enabled:
            message = self.stage if self.key is None else f"{self.stage} {self.key}"
            self.label = torch.autograd.profiler.record_function(f"graphattn::{message}")
            self.label.__enter__()
        if prof.nvtx is not None:
            prof.nvtx.push_range(prof.attributes(self.stage, self.key))
        prof.depth += 1
        if prof.record_times:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        prof = self.prof
        if prof.record_times:
            prof.times.setdefault(self.stage, []).append(time.perf_counter() - self.t0)
        prof.depth -= 1
        if prof.nvtx is not None:
            prof.nvtx.pop_range()
        if self.label is not None:
            self.label.__exit__(None, None, None)


_NULL = contextlib.nullcontext()
