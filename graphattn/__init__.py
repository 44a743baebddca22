"""graphattn: replay CUDA graphs and torch.compile artifacts at every step of LLM inference,
with every shape, kernel and graph picked from CPU upper bounds (no host read of device state).

The public surface::

    from graphattn import (GraphRunner, RunnerConfig, CompileConfig, RequestState,
                           SchedulerOutput, SamplingParams, CUDAGraphMode, BucketPolicy,
                           no_host_sync)

Names are imported on first use, so ``import graphattn`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"

# public name -> the module that defines it
_HOMES = {
    "BucketPolicy": "graphattn.buckets",
    "CompileConfig": "graphattn.config",
    "CUDAGraphMode": "graphattn.keys",
    "DraftModelProposer": "graphattn.capture.drafter",
    "GraphKey": "graphattn.keys",
    "GraphRunner": "graphattn.capture.runner",
    "NgramProposer": "graphattn.proposer",
    "RequestState": "graphattn.state",
    "RunnerConfig": "graphattn.config",
    "SamplingParams": "graphattn.sampling",
    "SchedulerOutput": "graphattn.state",
    "StepOutput": "graphattn.capture.step_output",
    "fuse_projections": "graphattn.models.projections",
    "swap_linears": "graphattn.backends.linear",
    "no_host_sync": "graphattn.sync",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from graphattn.backends.linear import swap_linears
    from graphattn.buckets import BucketPolicy
    from graphattn.capture.drafter import DraftModelProposer
    from graphattn.capture.runner import GraphRunner
    from graphattn.capture.step_output import StepOutput
    from graphattn.config import CompileConfig, RunnerConfig
    from graphattn.keys import CUDAGraphMode, GraphKey
    from graphattn.models.projections import fuse_projections
    from graphattn.proposer import NgramProposer
    from graphattn.sampling import SamplingParams
    from graphattn.state import RequestState, SchedulerOutput
    from graphattn.sync import no_host_sync


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'graphattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
